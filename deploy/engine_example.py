"""An engine beside the host tier (the ``engine`` service of deploy/compose.host.yaml): a transformers model that
answers one question about a published document, the document's prefix copied from the host tier's shared memory.

    python engine_example.py --socket /run/kdn/host.sock --edge http://edge-eu-1:8100 \\
        --token-file engine.token --trusted-keys trusted.keys --document harbor-policy "What is ...?"

It shows the engine's side of the host tier and nothing more: ``HostClient`` on the socket (it maps the segment
the host names, read-only), and ``KDNClient(host=...)`` with the region's edges behind it. Without a host tier
(not up, or its segment not this user's to read) it says so and loads from the edges; the report line it prints
names the tier each chunk came from.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="engine_example.py")
    p.add_argument("--socket", required=True, help="the host tier's socket (kdn host serve --socket)")
    p.add_argument("--edge", action="append", required=True, help="an edge of this region (repeatable)")
    p.add_argument("--token-file", required=True, help="this engine's token (read on --namespace)")
    p.add_argument("--trusted-keys", required=True, help="publisher keys: records they did not sign are misses")
    p.add_argument("--model", default="tiny-llama", help="the origin's model (default: %(default)s)")
    p.add_argument("--namespace", default="public")
    p.add_argument("--document", required=True, help="the manifest's name (kdn publish --name)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("question")
    return p


async def ask(args: argparse.Namespace) -> int:
    from kdn.adapters.hf import agenerate, load_model, prompt_tokens
    from kdn.auth import read_token
    from kdn.client import KDNClient
    from kdn.client.host import HostClient
    from kdn.wire.host import HostError

    lm = load_model(args.model)
    token = read_token(args.token_file)
    try:
        host: HostClient | None = await HostClient(args.socket, token=token).connect()
    except HostError as e:
        print(f"engine: no host tier ({e}): loading from the edges", file=sys.stderr)
        host = None
    try:
        async with KDNClient(edges=args.edge, token=token, trusted_keys=args.trusted_keys, host=host) as client:
            manifest = await client.manifest(args.namespace, args.document)
            if manifest is None:
                print(f"engine: no manifest {args.namespace}/{args.document} (published? readable with this token?)",
                      file=sys.stderr)
                return 1
            ids = prompt_tokens(lm.tokenizer, manifest, args.question)
            out = await agenerate(lm.model, lm.tokenizer, ids, client, namespace=args.namespace,
                                  max_new_tokens=args.max_new_tokens)
    finally:
        if host is not None:
            await host.close()
    print(out.report.line())
    print(out.text.strip())
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(ask(parser().parse_args())))
