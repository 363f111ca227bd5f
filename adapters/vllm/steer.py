"""Attention steering inside vLLM: a manifest's emphasis map, applied to a request's question and answer.

A request asks for it in its ``kv_transfer_params`` and carries a cache salt that names the plan
(``request_params`` builds both)::

    kdn, salt = request_params(manifest["emphasis"], steer=True)        # alpha=, heads= override the map's
    llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt=salt),
                 SamplingParams(..., extra_args={"kv_transfer_params": {"kdn": kdn}}))
    # OpenAI server: {"prompt": ..., "cache_salt": salt, "kv_transfer_params": {"kdn": kdn}}

The math is the HF adapter's (``kdn.adapters.hf.steer``): in the plan's ``(layer, head)`` pairs, query rows
at positions ``>= query_from`` (the end of the map's region unless the request says otherwise) add
``log(alpha)`` to their scores for the region's keys that are not emphasized. vLLM's attention kernels take
no per-key bias (CPU_ATTN takes ALiBi slopes and sinks; FlashAttention nothing), and no edit of the cached
K/V can stand in for one (a key moved by ``d`` moves its score by ``q.d``, which depends on the query), so
``install`` wraps ``impl.forward`` of each attention layer: vLLM's kernel runs for the whole batch as
always, then the steered rows of the steered heads are recomputed from the paged cache (the step's own
K/V are in it by then) with the bias, and written over the kernel's output. Every other row, head, layer
and request is the kernel's output untouched.

How a batch row is matched to its request: the scheduler side sends, per steered request and step, the
request's block tables and token counts (``SteerJob``); the row whose last token is written to the slot of
that request's last position is that request's. Two rows can share that slot only when two requests with
identical prompts hit the same cached blocks, which the salt limits to requests with the same plan. A
step that cannot be steered (no matching row, a layout that cannot be read, any error) leaves that
request's rows as the kernel wrote them and logs it once; it never fails the engine's step.

Why the salt: vLLM's prefix cache names blocks by their tokens, and a steered layer changes the K/V of
every later layer at the steered positions; without a salt an unsteered request could reuse a steered
request's question blocks (or the other way round). A steered request whose ``cache_salt`` does not contain
its plan's salt is run unsteered, with an error in the log (``request_params`` gives a request that is
not steered no plan salt: its K/V are plain). For the same reason a producer never saves a steered
request's chunks past ``query_from``, and a steered request loads from the KDN only up to it (published
K/V past it were computed unsteered).

Not steered (the layer is not wrapped, and a plan naming it logs an error): sliding window, ALiBi, sinks,
soft-capped logits, quantized (fp8) K/V; found at the first steered step: cache layouts
``paged.find_reader`` cannot read (none on CPU: each ISA's is learned) and backends whose metadata has no ``query_start_loc`` /
``slot_mapping`` (FlashInfer). An engine with tensor parallelism or speculative decoding refuses ``steer``.
On GPU, a connector with ``steer`` on asks vLLM for piecewise CUDA graphs: the wrapper is Python that a
captured full graph would skip (not run on a GPU yet).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput

from kdn.adapters import steering
from kdn.adapters.steering import SteerSpec
from kdn.adapters.vllm.question import QuestionSpec

log = logging.getLogger("kdn.adapters.vllm")


@dataclass(frozen=True)
class SteerJob:
    """One steered request's rows in this step: positions ``[first, first + n)`` are computed."""

    req_id: str
    spec: SteerSpec | QuestionSpec  # a question's: its plan is decided in the question's own step (question.py)
    first: int
    n: int
    block_ids: tuple[tuple[int, ...], ...]  # the request's block table, per KV cache group

    @property
    def end(self) -> int:
        return self.first + self.n


def request_params(emphasis: EmphasisMap | dict, *, steer: bool | None = True, alpha: float | None = None,
                   heads: Sequence[Sequence[int]] | None = None, query_from: int | None = None,
                   salt_prefix: str = "") -> tuple[dict[str, Any], str]:
    """``(the "kdn" part of kv_transfer_params, the cache_salt)`` of a steered request.

    ``salt_prefix``: a salt the request would carry anyway (a tenant's), kept in front of the plan's."""
    emap = emphasis if isinstance(emphasis, EmphasisMap) else EmphasisMap.from_dict(emphasis)
    kdn: dict[str, Any] = {"emphasis": emap.to_dict(), "steer": steer}
    if not (steer if steer is not None else emap.default_on):
        return kdn, salt_prefix  # not steered: its K/V are plain K/V, shared with every plain request
    if alpha is not None:
        kdn["steer_alpha"] = alpha
    if heads is not None:
        kdn["steer_heads"] = [list(p) for p in heads]
    if query_from is not None:
        kdn["steer_query_from"] = query_from
    return kdn, salt_prefix + steering.salt(emap, alpha=alpha, heads=heads, query_from=query_from)


def spec_of(params: dict, *, n_layers: int, n_heads: int, n_ids: int,
            cache_salt: str | None) -> SteerSpec | QuestionSpec | None:
    """The steering a request's ``kdn`` params ask for, or None; ``InvalidInput`` / ``ModelMismatch`` for a bad one
    (a malformed map, heads the model lacks, a region past the prompt, a missing salt)."""
    emphasis = params.get("emphasis")
    on = params.get("steer")
    if emphasis is None and not on:
        return None
    if on == "question":  # the question's own map, made in its pass (question.py)
        from kdn.adapters.vllm.question import spec_of as question_spec

        return question_spec(params, n_layers=n_layers, n_heads=n_heads, n_ids=n_ids, cache_salt=cache_salt)
    if on is not None and not isinstance(on, bool):
        raise InvalidInput(f"'steer' must be true, false, \"question\" or null, got {str(on)[:20]}")
    heads = params.get("steer_heads")
    if heads is not None and (not isinstance(heads, list) or not all(isinstance(p, (list, tuple)) for p in heads)):
        raise InvalidInput("'steer_heads' must be a list of [layer, head] pairs")
    spec = steering.resolve(emphasis, n_layers=n_layers, n_heads=n_heads, steer=on, alpha=params.get("steer_alpha"),
                            heads=heads, query_from=params.get("steer_query_from"), n_ids=n_ids)
    if spec is None or emphasis is None:  # (resolve plans nothing without a map)
        return None
    want = steering.salt(emphasis, alpha=params.get("steer_alpha"), heads=heads,
                         query_from=params.get("steer_query_from"))
    if want not in (cache_salt or ""):
        raise InvalidInput(f"a steered request needs a cache_salt containing {want!r} (request_params gives it): "
                           "vLLM's prefix cache would otherwise mix steered and unsteered K/V")
    return spec


# --- the worker: after vLLM's kernel, the steered rows again, with the bias --------------------------


def steerable(impl: Any) -> str | None:
    """Why a layer's attention cannot be steered, or None."""
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):  # CPU: -1; FlashAttention: (-1, -1)
        return "sliding window"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "logits_soft_cap", 0):
        return "soft-capped logits"
    if "fp8" in str(getattr(impl, "kv_cache_dtype", "auto")):
        return "fp8 K/V"
    return None


@dataclass
class _Keys:
    blocks: tuple[int, ...]  # the block table the keys were read through
    filled: int  # positions [0, filled) are in k and v
    k: torch.Tensor  # [Hs, capacity, D] float32
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * 4


class Steerer:
    """Wraps the attention layers' ``impl.forward`` once; applies the bound step's ``SteerJob`` list."""

    ROWS_PER_CALL = 256  # steered query rows per attention call: bounds the [heads, rows, keys] scores
    MAX_WARNED = 4096
    MAX_CACHED_BYTES = 512 << 20  # the running steered requests' keys kept between steps, at most
    MAX_DECIDED = 4096  # question maps' plans kept for their requests' later steps

    def __init__(self, layers: dict[str, Any], groups: dict[str, tuple[int, int]],
                 current: Callable[[], list[SteerJob] | None], *, rerun: bool = False) -> None:
        """``layers``: name -> ``worker.AttnLayer``; ``groups``: name -> (KV cache group, block size);
        ``current``: this step's jobs (the bound metadata's); ``rerun``: a sure question map may have vLLM
        compute the question again (``take_rerun``: the engine recomputes failed loads, one KV cache group)."""
        from kdn.adapters.vllm import paged

        self._paged = paged
        self.current = current
        self.groups = groups
        self.refused: dict[int, str] = {}  # layer index -> why it is not steered
        self.rows = 0  # steered query rows x layers, since start
        self._readers: dict[str, Any] = {}
        self._warned: set[tuple[str, int]] = set()
        self._seen: list[SteerJob] | None = None  # the step's job list last checked (held: its id may be reused)
        # (request, layer) -> its steered heads' K and V so far: a key's K/V never change once computed while
        # the request runs, so each step reads only the new positions from the paged cache.
        self._kv: dict[tuple[str, str], _Keys] = {}
        self._kv_bytes = 0
        # Question maps (question.py): a request's score while its question's step runs, then its plan (None:
        # unsure or not made), kept past the step for its answer's rows; the oldest dropped past MAX_DECIDED.
        self._making: dict[str, torch.Tensor] = {}
        self.decided: dict[str, SteerSpec | None] = {}
        self.maps: dict[str, int] = {}  # outcomes: sure, unsure, split (the question in two steps), no_row
        self.rerun = rerun and len({g for g, _ in groups.values()}) == 1
        self._step = 0  # steps seen (with jobs)
        self._deciding: dict[str, int] = {}  # request -> the step its map was decided in
        self._rerun_blocks: set[int] = set()  # reported as load errors: vLLM recomputes from the first
        self._rerunning: set[str] = set()  # requests whose question this step computes for nothing (rerun)
        for a in layers.values():
            why = steerable(a.module.impl)
            if why is not None:
                self.refused[a.index] = why
                continue
            self._wrap(a)

    def _wrap(self, a: Any) -> None:
        impl = a.module.impl
        inner = impl.forward  # bound to impl; called with vLLM's own arguments

        def forward(layer: Any, query: torch.Tensor, key: Any, value: Any, kv_cache: torch.Tensor, md: Any,
                    *args: Any, **kw: Any) -> Any:
            out = inner(layer, query, key, value, kv_cache, md, *args, **kw)
            jobs = self.current() if md is not None else None
            if jobs:
                output = kw.get("output", args[0] if args else None)
                self._apply(a, query, kv_cache, md, output if output is not None else out, jobs)
            elif self._kv and md is not None:
                self._kv.clear()  # no steered request in this step: nothing kept is needed any more
                self._kv_bytes = 0
            return out

        impl.forward = forward

    def _warn(self, job: SteerJob, layer: int, msg: str, *args: Any) -> None:
        if (job.req_id, layer) in self._warned:
            return
        if len(self._warned) >= self.MAX_WARNED:
            self._warned.clear()
        self._warned.add((job.req_id, layer))
        log.error("request %s: " + msg, job.req_id, *args)

    def _apply(self, a: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: Any, output: torch.Tensor,
               jobs: list[SteerJob]) -> None:
        if jobs is not self._seen:  # once per step: plans naming layers that are not wrapped; stale keys
            self._seen = jobs
            self._step += 1
            live = {j.req_id for j in jobs}
            for key in [k for k in self._kv if k[0] not in live]:
                self._kv_bytes -= self._kv.pop(key).nbytes
            for rid in [r for r in self._making if r not in live]:
                del self._making[rid]
            for job in jobs:
                sp = job.spec
                for la, _ in (sp.heads if isinstance(sp, SteerSpec) else sp.retrieval + sp.steer):
                    if la in self.refused:
                        self._warn(job, la, "layer %d is not steered (%s)", la, self.refused[la])
        mine = [j for j in jobs if (self._question_wants(j, a.index) if isinstance(j.spec, QuestionSpec)
                                    else j.spec.layer_heads(a.index) and j.spec.query_from < j.end)]
        if not mine:
            return
        qsl, slot_mapping = getattr(md, "query_start_loc", None), getattr(md, "slot_mapping", None)
        if qsl is None or slot_mapping is None:
            for job in mine:
                self._warn(job, -2, "the %s backend's metadata has no query_start_loc / slot_mapping: not steered",
                           type(md).__name__)
            return
        qsl = qsl.cpu()
        last_slot = slot_mapping[qsl[1:] - 1].cpu()  # [rows]: the slot each batch row's last token writes
        for job in mine:
            try:
                if isinstance(job.spec, QuestionSpec):
                    self._question(a, job, query, kv_cache, output, qsl, last_slot)
                else:
                    self._steer(a, job, query, kv_cache, output, qsl, last_slot)
            except Exception as e:  # noqa: BLE001 -- never fail the engine's step: this request runs unsteered
                self._warn(job, a.index, "layer %d is not steered: %s: %s", a.index, type(e).__name__, e)

    # --- the question's own map (question.py) -----------------------------------------------

    def _first_pass(self, job: SteerJob) -> bool:
        """Whether this step is the question's first computation (its map not made before this step)."""
        q = job.spec
        assert isinstance(q, QuestionSpec)
        asking = job.first < q.n_ids and job.end > q.query_from  # this step computes question rows
        return asking and (job.req_id not in self.decided or self._deciding.get(job.req_id) == self._step)

    def _question_wants(self, job: SteerJob, layer: int) -> bool:
        q = job.spec
        assert isinstance(q, QuestionSpec)
        first = self._first_pass(job)
        if first and q.retrieval_heads(layer):
            return True  # scored (or found split) at the retrieval layers
        if not (q.steers(layer) and q.query_from < job.end and isinstance(self.decided.get(job.req_id), SteerSpec)):
            return False
        return not first or (layer >= q.last_layer and job.req_id not in self._rerunning)

    def _question(self, a: Any, job: SteerJob, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                  qsl: torch.Tensor, last_slot: torch.Tensor) -> None:
        """A question-map request at this layer. The question's first computation: scored at the retrieval
        layers, decided at the last one; sure, vLLM is asked to compute the question again (``_rerun``: this
        pass's output is dropped) where it can be, else this pass is steered from that layer on. Any later
        computation of the question (the rerun), and the answer's rows: steered by that plan, every layer."""
        q = job.spec
        assert isinstance(q, QuestionSpec)
        if self._first_pass(job):
            if q.retrieval_heads(a.index):
                if job.first > q.query_from or job.end < q.n_ids:  # a chunked prefill split the question
                    if a.index == q.last_layer and job.first <= q.query_from:  # (counted in its first step)
                        self._decide(job, None, "split")
                else:
                    self._score(a, job, query, kv_cache, qsl, last_slot)
            if a.index < q.last_layer or job.req_id in self._rerunning:
                return
        plan = self.decided.get(job.req_id)
        if isinstance(plan, SteerSpec) and plan.layer_heads(a.index):
            self._steer(a, dataclasses.replace(job, spec=plan), query, kv_cache, output, qsl, last_slot)

    def _rerun(self, job: SteerJob, a: Any) -> bool:
        """Have vLLM compute the question again, now that its map is made: the last block computed before this
        step is reported as a failed load, so the engine recomputes from it (that block's K/V come out the same:
        nothing before the question is steered) and drops this step's token. False where it cannot (the
        question's step starts the request, several KV cache groups, a policy that fails failed loads)."""
        if not self.rerun or job.first == 0:
            return False
        group, block_size = self.groups[a.name]
        self._rerun_blocks.add(job.block_ids[group][(job.first - 1) // block_size])
        self._rerunning.add(job.req_id)
        return True

    def take_rerun(self) -> set[int]:
        """The blocks to report as load errors after this step (``get_block_ids_with_load_errors``)."""
        out, self._rerun_blocks = self._rerun_blocks, set()
        self._rerunning.clear()
        return out

    def _score(self, a: Any, job: SteerJob, query: torch.Tensor, kv_cache: torch.Tensor, qsl: torch.Tensor,
               last_slot: torch.Tensor) -> None:
        """What the question's rows pay the document at this layer's retrieval heads (unsteered: vLLM's own
        attention, recomputed from the paged cache and the step's queries), summed into the request's score;
        at the last retrieval layer, the decision."""
        q = job.spec
        assert isinstance(q, QuestionSpec)
        if a.index == q.retrieval[0][0]:
            self._making[job.req_id] = torch.zeros(q.region[1] - q.region[0])
        acc = self._making.get(job.req_id)
        rows = self._rows(job, a, qsl, last_slot)
        if acc is None or not rows:
            self._making.pop(job.req_id, None)
            self._decide(job, None, "no_row")
            return
        heads = q.retrieval_heads(a.index)
        group, block_size = self.groups[a.name]
        table = job.block_ids[group]
        read = self._reader(a, kv_cache)
        dev = query.device
        hs = torch.as_tensor(heads, dtype=torch.long, device=dev)
        kvh = hs // (query.shape[1] // a.kv_heads)
        L, rs, re_ = job.end, q.region[0], q.region[1]
        k, _ = read(kv_cache, self._paged.slots(table, 0, L, block_size, kv_cache.device))  # [L, Hkv, D]
        kk = k[:, kvh].transpose(0, 1).float()  # [Hr, L, D]
        keys, q0 = torch.arange(L, device=dev), int(qsl[rows[0]])
        r0, r1 = q.query_from - job.first, q.n_ids - job.first  # the question's rows (not an answer recomputed)
        paid = torch.zeros(len(heads), re_ - rs, device=dev)
        for c0 in range(r0, r1, self.ROWS_PER_CALL):
            c1 = min(c0 + self.ROWS_PER_CALL, r1)
            qpos = torch.arange(job.first + c0, job.first + c1, device=dev)
            mask = torch.zeros(len(qpos), L, device=dev).masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
            qq = query[q0 + c0:q0 + c1, hs].transpose(0, 1).float()  # [Hr, r, D]
            p = torch.softmax(torch.baddbmm(mask.expand(len(heads), -1, -1), qq, kk.transpose(1, 2),
                                            alpha=float(a.module.impl.scale)), dim=-1)  # [Hr, r, L]
            paid += p[:, :, rs:re_].sum(1)
        acc += (paid / (r1 - r0)).sum(0).cpu()  # each head's mean over the question's rows, summed
        if a.index == q.last_layer:
            plan, lead = q.decide(self._making.pop(job.req_id) / q.n_retrieval)
            self._decide(job, plan, "sure" if plan is not None else "unsure", lead)
            if plan is not None and self._rerun(job, a):
                self.maps["rerun"] = self.maps.get("rerun", 0) + 1

    def _decide(self, job: SteerJob, plan: SteerSpec | None, outcome: str, lead: float = 0.0) -> None:
        self.decided[job.req_id] = plan
        self._deciding[job.req_id] = self._step
        while len(self.decided) > self.MAX_DECIDED:
            oldest = next(iter(self.decided))
            del self.decided[oldest]
            self._deciding.pop(oldest, None)
        self.maps[outcome] = self.maps.get(outcome, 0) + 1
        if outcome in ("split", "no_row"):
            self._warn(job, -3, "its question ran %s: its map was not made, not steered",
                       "in more than one step" if outcome == "split" else "in no batch row found")
        else:
            log.info("request %s: question map %s (lead %.2f sd)", job.req_id,
                     "not sure: not steered" if plan is None else f"steers toward {list(plan.spans)}", lead)

    def _rows(self, job: SteerJob, a: Any, qsl: torch.Tensor, last_slot: torch.Tensor) -> list[int]:
        """The batch rows of ``job``'s request: the row whose last token is written to its last position's slot."""
        group, block_size = self.groups[a.name]
        last = int(self._paged.slots(job.block_ids[group], job.end - 1, job.end, block_size)[0])
        rows = (last_slot == last).nonzero().flatten().tolist()
        return [i for i in rows if int(qsl[i + 1] - qsl[i]) == job.n]

    def _steer(self, a: Any, job: SteerJob, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
               qsl: torch.Tensor, last_slot: torch.Tensor) -> None:
        assert isinstance(job.spec, SteerSpec)
        heads = job.spec.layer_heads(a.index)
        r0 = max(job.spec.query_from - job.first, 0)  # the first steered row of this step
        L = job.end
        group, block_size = self.groups[a.name]
        table = job.block_ids[group]
        rows = self._rows(job, a, qsl, last_slot)
        if not rows:
            self._warn(job, -1, "no batch row matches its steering job: not steered")
            return
        try:
            read = self._reader(a, kv_cache)
        except self._paged.LayoutUnknown as e:
            self._warn(job, a.index, "layer %d is not steered: %s", a.index, e)
            return
        dev = query.device
        hs = torch.as_tensor(heads, dtype=torch.long, device=dev)
        kvh = hs // (query.shape[1] // a.kv_heads)  # each steered query head's K/V head

        def gather(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = read(kv_cache, self._paged.slots(table, lo, hi, block_size, kv_cache.device))  # [n, Hkv, D]
            return k[:, kvh].transpose(0, 1).float(), v[:, kvh].transpose(0, 1).float()  # [Hs, n, D]

        kk, vv = self._keys(job, a.name, gather, tuple(table[:-(-L // block_size)]), L)
        bias = job.spec.key_bias(L).to(dev)  # [L]
        keys = torch.arange(L, device=dev)
        scale = float(a.module.impl.scale)
        for c0 in range(r0, job.n, self.ROWS_PER_CALL):
            c1 = min(c0 + self.ROWS_PER_CALL, job.n)
            qpos = torch.arange(job.first + c0, job.first + c1, device=dev)  # [r]
            mask = bias[None, :].expand(len(qpos), L).masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
            for i in rows:
                q0 = int(qsl[i])
                q = query[q0 + c0:q0 + c1, hs].transpose(0, 1).float()  # [Hs, r, D]
                # softmax(q k^T * scale + mask) v, written out: for a few query rows over ~1k keys this is
                # 2-3x faster on CPU than scaled_dot_product_attention with a float mask.
                scores = torch.baddbmm(mask.expand(len(heads), -1, -1), q, kk.transpose(1, 2), alpha=scale)
                o = torch.bmm(torch.softmax(scores, dim=-1), vv)  # [Hs, r, D]
                output[q0 + c0:q0 + c1, hs] = o.transpose(0, 1).to(output.dtype)
                self.rows += c1 - c0

    def _keys(self, job: SteerJob, layer: str, gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
              blocks: tuple[int, ...], L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The steered heads' K and V of positions ``[0, L)``, ``[Hs, L, D]``: kept per request and layer, and
        extended by the positions new since the last step (all of them again if its blocks changed: preempted)."""
        key = (job.req_id, layer)
        got = self._kv.get(key)
        if got is not None and (got.filled > L or blocks[:len(got.blocks)] != got.blocks):
            self._kv_bytes -= self._kv.pop(key).nbytes
            got = None
        if got is None or got.k.shape[1] < L:
            lo = got.filled if got is not None else 0
            k1, v1 = gather(lo, L)
            cap = L + max(64, L // 4)  # room for the next steps' keys
            if got is not None:
                self._kv_bytes -= self._kv.pop(key).nbytes
            if self._kv_bytes + 8 * k1.shape[0] * cap * k1.shape[2] > self.MAX_CACHED_BYTES:
                if got is None:
                    return k1, v1  # over the cap: read every key every step
                return torch.cat((got.k[:, :lo], k1), dim=1), torch.cat((got.v[:, :lo], v1), dim=1)
            k = k1.new_empty(k1.shape[0], cap, k1.shape[2])
            v = torch.empty_like(k)
            if got is not None:
                k[:, :lo], v[:, :lo] = got.k[:, :lo], got.v[:, :lo]
            k[:, lo:L], v[:, lo:L] = k1, v1
            got = self._kv[key] = _Keys(blocks, L, k, v)
            self._kv_bytes += got.nbytes
        elif got.filled < L:
            k1, v1 = gather(got.filled, L)
            got.k[:, got.filled:L], got.v[:, got.filled:L] = k1, v1
            got.filled, got.blocks = L, blocks
        return got.k[:, :L], got.v[:, :L]

    def _reader(self, a: Any, kv_cache: torch.Tensor) -> Any:
        r = self._readers.get(a.name)
        if r is None:
            try:
                r = self._paged.find_reader(a.module, kv_cache, a.kv_heads, a.head_dim)[1]
            except self._paged.LayoutUnknown as e:
                r = e
            self._readers[a.name] = r
        if isinstance(r, Exception):
            raise r
        return r
