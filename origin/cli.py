"""`kdn origin serve`, `kdn publish` and (``relation_cli``) `kdn relation`. Imports nothing heavy until a command
runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kdn.errors import InvalidInput, KDNError


def register(sub: argparse._SubParsersAction) -> None:
    from kdn.origin import relation_cli

    _register_origin(sub)
    _register_publish(sub)
    relation_cli.register(sub)


def _register_origin(sub: argparse._SubParsersAction) -> None:
    origin = sub.add_parser("origin", help="run an origin node").add_subparsers(dest="origin_command", required=True)
    p = origin.add_parser("serve", help="serve publish requests and the objects they produce")
    _serve_node_args(p)
    _serve_service_args(p)
    p.set_defaults(func=cmd_serve)

    p = origin.add_parser("keygen", help="make an origin signing key (FILE, mode 600) and FILE.pub for consumers")
    p.add_argument("--out", required=True, metavar="FILE")
    p.set_defaults(func=cmd_keygen)


def _serve_node_args(p: argparse.ArgumentParser) -> None:
    """`kdn origin serve`: the model and what computes it, the registry, the store, where it listens, its key."""
    from kdn.registry.url import registry_arg

    p.add_argument("--model", default="tiny-llama",
                   help="tiny-llama, tiny-bamba, ..., smollm2-135m, a transformers folder or a .gguf file")
    registry_arg(p)
    p.add_argument("--store", default="kdn-origin-store",
                   help="object store: a folder, or s3://BUCKET/PREFIX?endpoint=URL (an S3-compatible bucket that "
                        "several origins may share; docs/operations.md)")
    p.add_argument("--store-credentials", default=None, metavar="FILE",
                   help="an s3:// store's keys: aws_access_key_id and aws_secret_access_key (INI, as in "
                        "~/.aws/credentials); default: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else unsigned")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", default=None, help="grants file (see README: Tokens); without it anyone may publish nothing")
    p.add_argument("--region", default="origin")
    p.add_argument("--node-id", default=None)
    p.add_argument("--url", default=None, help="URL advertised in the registry (default http://HOST:PORT)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-pending-jobs", type=int, default=16)
    p.add_argument("--max-body-bytes", default="16MiB", metavar="SIZE",
                   help="the largest request body taken (a publish, an ingested object: PUT /v1/objects); default 16MiB")
    p.add_argument("--signing-key", default=None, metavar="FILE",
                   help="Ed25519 key (kdn origin keygen) that signs every object record and manifest")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="what computes the states: transformers (default) or vLLM (pip install 'kdn[vllm]')")


def _serve_service_args(p: argparse.ArgumentParser) -> None:
    """`kdn origin serve`: TLS, connection caps, what a publish stores, its admission, where records go, and
    the hosts the console may send a token to."""
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections open at once (default: 3/4 of `ulimit -n`; docs/operations.md)")
    p.add_argument("--max-connections-per-peer", type=int, default=None, metavar="N",
                   help="of those, from one address (default: half of --max-connections)")
    p.add_argument("--kvtc-basis", default=None, metavar="FILE",
                   help="the model's kvtc basis file (fit_basis in kdn.adapters.hf.transform_fit; docs/operations.md): "
                        "enables kvtc-B encodings")
    p.add_argument("--raw-copies", default="auto", choices=["auto", "always", "never"],
                   help="a publish naming no encodings stores raw beside zstd (raw loads fastest next to an engine, "
                        "zstd across a WAN); auto: while the store's disk is under 75%% full")
    p.add_argument("--piece-bytes", default="1MiB", metavar="SIZE",
                   help="records carry the BLAKE3 of each SIZE piece of a blob, so a consumer verifies (and may use) "
                        "a body piece by piece as it lands, and drops a lying source within a piece (64KiB-1GiB; "
                        "default 1MiB)")
    p.add_argument("--admission", default=None, metavar="FILE",
                   help="this origin's admission (kdn node admit), carried in its node record for edges that "
                        "require admissions (--require-admission)")
    p.add_argument("--records", default="store", choices=["store", "registry"],
                   help="where object records go: the store beside the blobs (the default: records.sqlite3 in a "
                        "folder store, objects under records/ in an s3:// one; the registry then keeps models, "
                        "manifest pointers, nodes and policies only, and edges on their default --records auto "
                        "read records here), or the registry (one etcd record per chunk, as before; docs/scale.md)")
    p.add_argument("--deny-floor-ms", type=float, default=2.0, metavar="MS",
                   help="answer a 'no' (an absent object, or another tenant's) no sooner than this, or than recent "
                        "'no's take if longer, so its timing does not tell which (default 2; 0: off)")
    p.add_argument("--probe-token-file", default=None, metavar="FILE",
                   help="the token the operator console (/console) shows edges when it asks what they hold (grant it "
                        "`read *` in the edges' token files and nothing here); without it the console says unknown. "
                        "It never sends a signed-in user's own token")
    p.add_argument("--token-hosts", default=None, metavar="PATTERNS",
                   help="hosts the probe token may be sent to (comma-separated names, globs or address blocks; "
                        "default loopback): edge URLs come from the registry")
    p.add_argument("--operator-keys", default=None, metavar="FILE",
                   help="operator keys: with --require-admission the console asks and scrapes only edges one of "
                        "them admitted (kdn node admit)")
    p.add_argument("--require-admission", action="store_true",
                   help="the console asks only edges an --operator-keys key admitted; the others show as unknown")
    p.add_argument("--revoked-admissions", default=None, metavar="FILE",
                   help="with --require-admission: admission ids the operator revoked (kdn node revoke)")


def _register_publish(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish documents through an origin")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files ('-' for stdin)")
    p.add_argument("--origin", default=os.environ.get("KDN_ORIGIN", "http://127.0.0.1:8000"))
    p.add_argument("--name", default=None, help="manifest name (default: the file name without suffix)")
    p.add_argument("--namespace", default="public")
    p.add_argument("--token-file", default=None, help="file whose first token is the publisher token (or $KDN_TOKEN)")
    p.add_argument("--template", default=None, choices=["none", "chat"], help="publish the document inside a chat turn")
    p.add_argument("--system", default=None, help="system message for --template chat")
    p.add_argument("--prefix-text", default=None, help="literal text published before the document")
    p.add_argument("--standalone", action="store_true", help="also publish position-independent chunks")
    p.add_argument("--no-prefix", action="store_true", help="publish standalone chunks only")
    p.add_argument("--emphasize", action="append", default=None, metavar="TEXT",
                   help="mark every occurrence of TEXT as emphasized (repeatable): stored, signed, with the manifest "
                        "for engines that steer attention to it (docs/whitebox.md)")
    p.add_argument("--emphasis-alpha", type=float, default=None, metavar="A",
                   help="with --emphasize: the attention scale on the other tokens the map suggests (0 < A <= 1)")
    p.add_argument("--emphasis-default-on", action="store_true",
                   help="with --emphasize: engines steer without being asked (a request can still turn it off)")
    p.add_argument("--question-heads", default=None, metavar="L:H,...",
                   help="the model's calibrated retrieval heads (kdn.adapters.hf.question_map.calibrate): the origin "
                        "stores what a content-free question pays each sentence there, so engines making the "
                        "question's own map skip that pass (docs/whitebox.md)")
    p.add_argument("--json", action="store_true", help="print the manifests as JSON")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for an origin that is still starting (default 120)")
    p.add_argument("--ca", default=None, metavar="FILE", help="CA bundle to verify an HTTPS origin (default: system CAs, or $KDN_CA)")
    p.set_defaults(func=cmd_publish)


def cmd_serve(args: argparse.Namespace) -> int:
    from kdn.format.address import validate_name
    from kdn.origin.app import OriginConfig, run
    from kdn.registry.records import validate_node_url
    from kdn.units import parse_size

    if args.url is not None:
        args.url = validate_node_url(args.url.rstrip("/"))
    cfg = OriginConfig(model=args.model, registry=args.registry, store=args.store, host=args.host, port=args.port,
                       token_file=args.token_file, region=validate_name(args.region), url=args.url, dtype=args.dtype,
                       max_pending_jobs=args.max_pending_jobs, tls_cert=args.tls_cert, tls_key=args.tls_key,
                       engine=args.engine, signing_key=args.signing_key, kvtc_basis=args.kvtc_basis,
                       raw_copies=args.raw_copies, piece_bytes=parse_size(args.piece_bytes),
                       store_credentials=args.store_credentials, records=args.records, admission=args.admission,
                       max_connections=args.max_connections, max_connections_per_peer=args.max_connections_per_peer,
                       token_hosts=args.token_hosts, probe_token_file=args.probe_token_file,
                       operator_keys=args.operator_keys, require_admission=args.require_admission,
                       revoked_admissions=args.revoked_admissions, deny_floor_ms=args.deny_floor_ms,
                       max_body_bytes=parse_size(args.max_body_bytes))
    cfg.admitters()  # a key or revocation file that does not load fails here, in one line
    if args.probe_token_file:
        from kdn.auth import read_token

        read_token(args.probe_token_file)  # an unreadable or empty file fails here, in one line
    if args.token_hosts is not None:
        from kdn.auth import TokenScope

        TokenScope(args.token_hosts)  # a bad pattern fails here, in one line
    cfg.connection_caps()  # bad caps fail here, in one line
    if args.signing_key:
        from kdn.registry.signing import Signer

        Signer.load(args.signing_key)  # a bad or world-readable key fails here, in one line
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidInput("--tls-cert and --tls-key go together")
    if args.node_id:
        cfg.node_id = validate_name(args.node_id)
    run(cfg)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from kdn.registry.signing import Signer

    signer = Signer.generate(args.out)
    print(f"signing key {args.out} (keep it private); give consumers its public key, also in {args.out}.pub:")
    print(signer.public)
    return 0


def _heads(text: str) -> list[list[int]]:
    """``"12:3,14:1"`` -> ``[[12, 3], [14, 1]]`` (InvalidInput otherwise)."""
    try:
        pairs = [[int(x) for x in part.split(":")] for part in text.split(",") if part.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs):
        raise InvalidInput(f"--question-heads takes LAYER:HEAD pairs separated by commas, got {text[:40]!r}")
    return pairs


def cmd_publish(args: argparse.Namespace) -> int:
    import aiohttp  # noqa: F401  (fail early if the HTTP client is missing)

    from kdn.auth import read_token

    token = read_token(args.token_file)
    docs = []
    for f in args.files:
        try:
            text = sys.stdin.read() if f == "-" else Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidInput(f"cannot read {f!r}: {e}") from None
        stem = "stdin" if f == "-" else Path(f).stem
        name = args.name if args.name and len(args.files) == 1 else (f"{args.name}.{stem}" if args.name else stem)
        docs.append((name, text))
    body_common = {"namespace": args.namespace, "standalone": args.standalone, "prefix": not args.no_prefix}
    for key in ("template", "system", "prefix_text"):
        if getattr(args, key) is not None:
            body_common[key] = getattr(args, key)
    if args.emphasize:
        emphasis: dict = {"texts": args.emphasize, "default_on": args.emphasis_default_on}
        if args.emphasis_alpha is not None:
            emphasis["alpha"] = args.emphasis_alpha
        body_common["emphasis"] = emphasis
    elif args.emphasis_alpha is not None or args.emphasis_default_on:
        raise InvalidInput("--emphasis-alpha and --emphasis-default-on go with --emphasize")
    if args.question_heads:
        body_common.setdefault("emphasis", {})["question_heads"] = _heads(args.question_heads)
    import asyncio

    from kdn.registry import Manifest
    from kdn.registry.signing import manifest_pin

    manifests = asyncio.run(publish_documents(args.origin.rstrip("/"), token, docs, body_common, args.timeout,
                                         progress=not args.json and sys.stderr.isatty(), ca=args.ca,
                                         args_wait=args.wait))
    if args.json:
        print(json.dumps(manifests if len(manifests) > 1 else manifests[0], indent=2))
    else:
        for m in manifests:
            emph = m.get("emphasis")
            print(f"published {m['namespace']}/{m['name']}: {m['tokens']} tokens, {len(m['addresses'])} chunks"
                  f" (+{len(m['standalone'])} standalone), model {m['model_id'][:16]}..."
                  + (f", {len(emph['spans'])} emphasized spans" if emph else "")
                  + (f", content-free scores of {len(emph['baseline']['sentences'])} sentences"
                     if emph and emph.get("baseline") else ""))
            print(f"  pin {manifest_pin(Manifest.from_dict(m))} (version {m.get('version', 0)}): "
                  "KDNClient.manifest(..., pin=) takes this manifest and no other")
            for i, a in enumerate(m["addresses"]):
                print(f"  {i:>4} {a}")
    return 0


async def _await_origin(s, origin: str, seconds: float) -> None:
    """Wait up to ``seconds`` for an origin that is still starting (``kdn origin serve ... &`` just ran)."""
    import asyncio

    import aiohttp

    deadline = time.monotonic() + seconds
    said = False
    while True:
        try:
            async with s.get(f"{origin}/healthz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        if time.monotonic() > deadline:
            return  # the publish below reports what is wrong
        if not said:
            print(f"waiting for the origin at {origin} ...", file=sys.stderr)
            said = True
        await asyncio.sleep(0.5)


async def publish_documents(origin: str, token: str | None, docs, common: dict, timeout: float, progress: bool,
                            ca: str | None = None, args_wait: float = 0.0) -> list[dict]:
    """Publish ``docs`` (``(name, text)`` pairs, each with the fields in ``common``) through ``origin``
    one after the other, waiting for each job; the manifests, in order. What ``kdn publish`` and
    ``kdn up`` call."""
    import aiohttp

    from kdn.tls import client_context

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    out = []
    connector = aiohttp.TCPConnector(ssl=client_context(ca))
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as s:
        await _await_origin(s, origin, args_wait)
        for name, text in docs:
            try:
                async with s.post(f"{origin}/v1/publish", json={**common, "name": name, "text": text}) as r:
                    body = await _json(r)
            except aiohttp.ClientError as e:
                raise KDNError(f"cannot reach origin {origin}: {e}") from None
            job_url = f"{origin}/v1/jobs/{body['job']}"
            out.append(await _wait(s, job_url, name, timeout, progress))
    return out


async def _json(r) -> dict:
    try:
        body = await r.json(content_type=None)
    except ValueError:
        body = {"error": "bad_response", "detail": (await r.text())[:200]}
    if r.status >= 400:
        raise KDNError(f"origin answered {r.status} {body.get('error')}: {body.get('detail')}")
    return body


async def _wait(s, job_url: str, name: str, timeout: float, progress: bool) -> dict:
    import asyncio

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(desc=f"publish {name}", unit="chunk", leave=True)
        except ImportError:
            bar = None
    deadline = time.monotonic() + timeout
    delay = 0.05
    try:
        while True:
            async with s.get(job_url) as r:
                job = await _json(r)
            if bar is not None:
                bar.total = job["progress"]["total"] or None
                bar.n = job["progress"]["done"]
                bar.refresh()
            if job["state"] == "done":
                return job["manifest"]
            if job["state"] == "failed":
                raise KDNError(f"publish of {name!r} failed: {job['error']}")
            if time.monotonic() > deadline:
                raise KDNError(f"publish of {name!r} did not finish within {timeout:.0f} s (job {job_url})")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)
    finally:
        if bar is not None:
            bar.close()
