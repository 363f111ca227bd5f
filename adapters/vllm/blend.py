"""Non-prefix reuse in vLLM: a RAG prompt's documents, each published alone, composed at question time.

A request whose prompt is ``[head][document 1]..[document k][question]`` names its documents' spans in its
``kv_transfer_params`` and carries a cache salt that names the blend (``blend_params`` builds both;
``rag_prompt`` builds the prompt and the spans from text, as ``kdn.adapters.hf.rag`` does)::

    ids, spans = rag_prompt(tokenizer, "What is the hotel limit?", [doc_a, doc_b])
    kdn, salt = blend_params(spans, ratio=0.15)
    llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=salt),
                 SamplingParams(..., extra_args={"kv_transfer_params": {"kdn": kdn}}))

Each document's chunks were published with ``"standalone": true`` (computed alone at positions 0..n-1,
addressed by their tokens only), so any prompt that holds a document, in any order and with any other
documents, finds them. The scheduler side asks the KDN which of them it has (their records); where it has
any, it offers vLLM every prompt token up to the last whole block before the end, and the worker side, in
that step's ``start_load_kv``, fetches and verifies the chunks, shifts each one's keys to its place in
this prompt and blends them: CacheBlend's selective recompute (``kdn.adapters.hf.blend.blend_prefill``:
every token through the check layer, then only the ``ratio`` of reused tokens whose K/V deviate most,
weighed by the attention the question pays them, and the fresh tokens (head, question, chunks the KDN did
not have) through the rest). The blended K/V are written into the request's blocks with the backend's own
write; vLLM computes the last tokens itself, its own kernels over the blended cache.

How a connector runs a forward it does not own: vLLM gives a KV connector the attention layers and never
the model. The worker finds the model that owns those layers once (``compat.decoder_model``) and drives
its own modules (``kdn.adapters.vllm.blend_run.VllmOps``: vLLM's fused projections, its RoPE, norms and
MLP; the attention of a partial recompute is KDN's, over the composed K/V). What vLLM would need to make
this a plain connector feature is written in docs/whitebox.md ("In vLLM").

``ratio`` 1 recomputes every token: that is the engine's own prefill, so the connector loads nothing and
vLLM computes the prompt itself (bit for bit what it computes without the KDN). ``ratio`` 0 composes only.

Why the salt: vLLM's prefix cache names blocks by their tokens. Blended K/V are not the K/V a plain
prefill of the same tokens makes, so a plain request must never reuse them, nor a blend of another ratio.
A blend request whose ``cache_salt`` does not contain its salt runs unblended, with an error in the log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdn.errors import InvalidInput, KDNError
from kdn.format import address as A
from kdn.format.address import ModelId

from kdn.adapters.hf.blend import SELECTIONS
from kdn.adapters.vllm import compat

if TYPE_CHECKING:  # pragma: no cover
    from kdn.registry.records import ObjectRecord

log = logging.getLogger("kdn.adapters.vllm")

MAX_DOCUMENTS = 64  # spans a request may name
MAX_CHUNKS = 512  # standalone chunks a blend may fetch (the documents' tokens / chunk_tokens)
FIRST_WAIT = 0.02  # seconds the first ``matched`` call waits for the records before answering "ask again"


@dataclass(frozen=True)
class BlendSpec:
    """A request's blend: its documents' spans in prompt positions and ``blend_prefill``'s settings."""

    documents: tuple[tuple[int, int], ...]
    ratio: float = 0.15
    selection: str = "deviation-query"
    check_layer: int = 1

    @property
    def salt(self) -> str:
        """The cache salt blocks blended this way carry (``blend_params``)."""
        key = f"{self.ratio!r}|{self.selection}|{self.check_layer}".encode()
        return "kdn-blend-" + hashlib.blake2b(key, digest_size=6).hexdigest()


def blend_params(documents: Sequence[Sequence[int]], *, ratio: float = 0.15, selection: str = "deviation-query",
                 check_layer: int = 1) -> tuple[dict, str]:
    """A request's ``kdn`` params and its cache salt for a blend of these document spans ``[start, end)``."""
    spec = BlendSpec(tuple((int(s), int(e)) for s, e in documents), float(ratio), selection, int(check_layer))
    kdn = {"blend": {"documents": [list(d) for d in spec.documents], "ratio": spec.ratio,
                     "selection": spec.selection, "check_layer": spec.check_layer}}
    return kdn, spec.salt


def rag_prompt(tokenizer: Any, query: str, documents: Sequence[str], system: str | None = None
               ) -> tuple[list[int], list[tuple[int, int]]]:
    """A RAG prompt's token ids and its documents' spans: each document tokenized alone, as the origin
    tokenizes a standalone publish, inside the chat template's frame (``kdn.adapters.hf.rag.rag_frame``)."""
    from kdn.template import encode_frame, encode_text

    from kdn.adapters.hf.rag import rag_frame

    if not documents:
        raise InvalidInput("a RAG prompt needs at least one document")
    head_text, tail_text = rag_frame(tokenizer, query, system)
    ids = list(encode_frame(tokenizer, head_text))
    spans = []
    for d in documents:
        toks = encode_text(tokenizer, d)
        if not toks:
            raise InvalidInput("an empty document")
        spans.append((len(ids), len(ids) + len(toks)))
        ids += toks
    return ids + list(encode_frame(tokenizer, tail_text)), spans


def spec_of(params: dict, *, n_ids: int, n_layers: int, cache_salt: str | None) -> BlendSpec:
    """The request's blend, checked whole (raises ``InvalidInput`` naming what is wrong)."""
    b = params.get("blend")
    if "emphasis" in params or params.get("steer"):
        raise InvalidInput("a request blends or steers, not both")
    if not isinstance(b, dict):
        raise InvalidInput("'blend' must be an object with 'documents'")
    unknown = set(b) - {"documents", "ratio", "selection", "check_layer"}
    if unknown:
        raise InvalidInput(f"unknown blend keys {sorted(unknown)}")
    docs = b.get("documents")
    if not isinstance(docs, list) or not 0 < len(docs) <= MAX_DOCUMENTS:
        raise InvalidInput(f"blend 'documents' must be a list of 1-{MAX_DOCUMENTS} [start, end) spans")
    spans: list[tuple[int, int]] = []
    for d in docs:
        if not (isinstance(d, list | tuple) and len(d) == 2 and all(type(x) is int for x in d)):
            raise InvalidInput(f"a document span must be [start, end] integers, not {d!r}")
        s, e = d
        if not (0 <= s < e <= n_ids) or (spans and s < spans[-1][1]):
            raise InvalidInput(f"document span [{s}, {e}) is not inside the {n_ids}-token prompt, after the last")
        spans.append((s, e))
    ratio = b.get("ratio", 0.15)
    if type(ratio) not in (int, float) or not 0.0 <= ratio <= 1.0:
        raise InvalidInput(f"blend 'ratio' must be a number in [0, 1], not {ratio!r}")
    selection = b.get("selection", "deviation-query")
    if selection not in SELECTIONS:
        raise InvalidInput(f"blend 'selection' must be one of {list(SELECTIONS)}, not {selection!r}")
    check = b.get("check_layer", 1)
    if type(check) is not int or not 0 <= check < n_layers:
        raise InvalidInput(f"blend 'check_layer' must be a layer of this {n_layers}-layer model, not {check!r}")
    if selection in ("deviation-kv", "deviation-query") and check == 0 and 0 < ratio < 1:
        raise InvalidInput(f"{selection} needs check_layer >= 1 (layer 0's K/V do not depend on the context)")
    spec = BlendSpec(tuple(spans), float(ratio), selection, check)
    if spec.salt not in (cache_salt or ""):
        raise InvalidInput(f"a blend's cache_salt must contain {spec.salt} (blend_params gives it): blended "
                           "K/V must not be found by a plain request in vLLM's prefix cache")
    return spec


@dataclass(frozen=True)
class BlendJob:
    """Blend ``tokens`` and write positions ``[computed, end)`` into ``block_ids`` (the attention group's)."""

    req_id: str
    tokens: tuple[int, ...]
    computed: int  # vLLM's own prefix-cache hit: read back as it is, never recomputed
    end: int
    block_ids: tuple[int, ...]
    chunks: tuple[tuple[A.Address, int, int], ...]  # (standalone address, start, end) the KDN has
    spec: BlendSpec


@dataclass
class _Asked:
    future: concurrent.futures.Future  # -> the chunks the KDN has, as BlendJob.chunks
    started: float
    chunks: tuple[tuple[A.Address, int, int], ...] | None = None


@dataclass
class BlendScheduler:
    """The scheduler side: which requests blend, what they offer vLLM, and the jobs for the worker."""

    client: Any
    bridge: Any
    model_id: ModelId
    namespace: str
    chunk_tokens: int
    block_size: int
    n_layers: int
    lookup_timeout: float
    enabled: bool = False  # the connector's ``blend`` setting
    refused: int = 0  # blend requests run unblended (a bad spec, no salt, blending off)
    _specs: dict[str, BlendSpec | None] = field(default_factory=dict)
    _asked: dict[str, _Asked] = field(default_factory=dict)
    _offered: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (computed, end)
    _ready: list[BlendJob] = field(default_factory=list)

    def spec_for(self, request: Any) -> BlendSpec | None:
        """The request's blend, decided once (a refusal logged and counted once); None: not a blend."""
        rid = request.request_id
        if rid in self._specs:
            return self._specs[rid]
        params = compat.kdn_params(request)
        spec = None
        if "blend" in params:
            try:
                if not self.enabled:
                    raise KDNError("blending is off on this engine (the connector's 'blend' setting)")
                spec = spec_of(params, n_ids=len(compat.prompt_tokens(request)), n_layers=self.n_layers,
                               cache_salt=compat.cache_salt(request))
            except KDNError as e:
                self.refused += 1
                log.error("request %s runs unblended: %s", rid, e)
        self._specs[rid] = spec
        return spec

    def matched(self, request: Any, spec: BlendSpec, computed: int) -> tuple[int | None, bool]:
        """Tokens the blend offers beyond ``computed`` (in the forward: never async), or None: ask again."""
        rid = request.request_id
        tokens = compat.prompt_tokens(request)
        end = (len(tokens) - 1) // self.block_size * self.block_size  # vLLM takes external hits in whole blocks
        if spec.ratio == 1.0 or end <= computed:
            return 0, False  # ratio 1 is the engine's own prefill; or vLLM's own cache has it all
        asked = self._asked.get(rid)
        if asked is None:
            asked = self._asked[rid] = _Asked(self.bridge.submit(self._held(tokens, spec)), time.monotonic())
            try:
                asked.future.result(FIRST_WAIT)
            except (concurrent.futures.TimeoutError, Exception):  # noqa: BLE001 -- read below
                pass
        if asked.chunks is None:
            if not asked.future.done():
                if time.monotonic() - asked.started < self.lookup_timeout:
                    return None, False
                asked.future.cancel()
                log.warning("KDN records for blend %s took over %.1f s: computing it instead", rid, self.lookup_timeout)
                asked.chunks = ()
            elif asked.future.cancelled() or asked.future.exception() is not None:
                log.warning("KDN records for blend %s failed: %s", rid, asked.future.exception()
                            if not asked.future.cancelled() else "cancelled")
                asked.chunks = ()
            else:
                asked.chunks = asked.future.result()
        if not any(lo < end and hi > computed for _, lo, hi in asked.chunks):
            return 0, False  # nothing the KDN has lands in what vLLM would load: it computes the prompt
        self._offered[rid] = (computed, end)
        return end - computed, False

    async def _held(self, tokens: list[int], spec: BlendSpec) -> tuple[tuple[A.Address, int, int], ...]:
        """The documents' standalone chunks whose records the KDN has (for this model and namespace)."""
        chunks = []
        for s, e in spec.documents:
            doc = tokens[s:e]
            for a, b in A.chunk_spans(e - s, self.chunk_tokens):
                chunks.append((A.standalone_address(self.model_id, self.namespace, doc[a:b]), s + a, s + b))
        if len(chunks) > MAX_CHUNKS:
            raise InvalidInput(f"a blend of {len(chunks)} chunks is over {MAX_CHUNKS}")

        async def rec(a: A.Address) -> ObjectRecord | None:
            try:
                return await self.client.record(a)
            except KDNError:
                return None

        recs = await asyncio.gather(*(rec(a) for a, _, _ in chunks))
        return tuple(c for c, r in zip(chunks, recs) if _standalone_of(r, self.model_id, self.namespace))

    def allocated(self, request: Any, blocks: Any, n: int) -> bool:
        """Queue the worker's job when vLLM took the blend's offer; True when this request is a blend's."""
        rid = request.request_id
        offered = self._offered.get(rid)
        spec = self._specs.get(rid)
        if offered is None or spec is None:
            return False
        if n > 0:
            computed, end = offered
            asked = self._asked[rid]
            if n != end - computed or asked.chunks is None:
                log.error("vLLM allocated %d external tokens for blend %s, the KDN offered %d", n, rid, end - computed)
            else:
                table = compat.block_ids_of(blocks)[0]
                self._ready.append(BlendJob(rid, tuple(compat.prompt_tokens(request)), computed, end, tuple(table),
                                            asked.chunks, spec))
        return True

    def jobs(self) -> list[BlendJob]:
        out, self._ready = self._ready, []
        return out

    def finished(self, rid: str) -> None:
        for d in (self._specs, self._asked, self._offered):
            d.pop(rid, None)


def _standalone_of(rec: ObjectRecord | None, model_id: ModelId, namespace: str) -> bool:
    return rec is not None and rec.model_id == model_id and rec.namespace == namespace and rec.standalone
