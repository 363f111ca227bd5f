"""docs/openapi.yaml against the code: the same routes, and a live origin and edge that keep to it.

The fuzzing is ``bench/fuzz_http.py`` (schemathesis, positive and negative cases per operation,
checks listed there) with a few examples per operation; the bench runs the same with many more.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kdn_bench_fuzz_http", ROOT / "bench" / "fuzz_http.py")
fuzz = sys.modules.setdefault("kdn_bench_fuzz_http", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fuzz)

from edge_helpers import EDGE_TOKEN, PUBLISH, cluster, publish  # noqa: E402  (bench/fuzz_http.py put it on the path)

EXAMPLES = 30  # per operation and generation mode; bench/fuzz_http.py --examples for a longer run
HTTP_METHODS = {"get", "head", "post", "put", "patch", "delete", "options"}


def _documented(service: str) -> set[tuple[str, str]]:
    spec = yaml.safe_load(fuzz.SPEC.read_text())
    return {(method.upper(), path) for path, item in spec["paths"].items() for method, op in item.items()
            if method in HTTP_METHODS and service in op.get("tags", ())}


def _registered(app) -> set[tuple[str, str]]:
    return {(route.method, route.resource.canonical) for route in app.router.routes()}


def test_the_spec_names_every_route_of_both_apps_and_no_other(tmp_path):
    from kdn.edge.app import EdgeConfig, create_app as create_edge
    from kdn.origin.app import OriginConfig, create_app as create_origin

    apps = {"origin": create_origin(OriginConfig(store=str(tmp_path / "store"))), "edge": create_edge(EdgeConfig())}
    for service, app in apps.items():
        registered, documented = _registered(app), _documented(service)
        assert registered == documented, (
            f"{service}: routes not in docs/openapi.yaml: {sorted(registered - documented)}; "
            f"in docs/openapi.yaml (tag {service!r}) but not routed: {sorted(documented - registered)}")


def test_the_spec_is_valid_openapi():
    import schemathesis

    schema = schemathesis.openapi.from_path(fuzz.SPEC)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    ops = [r.ok() for r in schema.get_all_operations()]
    assert all(schema.get_tags(op) for op in ops), "every operation says which service serves it"
    ids = [schema.get_operation_id(op) for op in ops]
    assert all(ids) and len(set(ids)) == len(ids), ids


@pytest.mark.timeout(240)
async def test_fuzzing_the_origin_and_an_edge_finds_nothing(tmp_path, etcd_url):
    report = await fuzz.run(tmp_path, etcd_url, examples=EXAMPLES, seed=0)
    assert not report.failures, "\n".join(report.failures)
    for service, ops in report.results.items():
        for label, r in ops.items():
            assert r.total > 0, f"{service} {label}: no case ran"
    # The run reached past auth and validation: documents were published, objects and records served.
    origin, edge = report.results["origin"], report.results["edge"]
    assert origin["POST /v1/publish"].statuses[202] > 0
    assert report.jobs["done"] > 0 and report.jobs["unfinished"] == 0
    for ops in (origin, edge):
        for label in ("GET /v1/objects/{address}", "POST /v1/lookup", "GET /v1/registry/objects/{address}",
                      "GET /v1/registry/manifests/{namespace}/{name}"):
            assert ops[label].statuses[200] > 0, (label, ops[label].statuses)
    assert edge["POST /v1/prefetch"].statuses[202] > 0


async def _raw(host: str, port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 5)
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


def _error(body: bytes) -> dict:
    err = json.loads(body)
    assert set(err) == {"error", "detail"} and "\n" not in err["detail"], err
    return err


async def test_what_fuzzing_found_gets_one_line_4xx(tmp_path, etcd_url):
    """Each of these was a 500 with a traceback in the log (or a 405 without ``Allow``)."""
    async with cluster(tmp_path, etcd_url, edges=("e1",)) as c:
        m = await publish(c, "Harbor hours: the pier opens at six and closes at ten. " * 6)
        address = m["addresses"][0].encode()
        for server in (c.origin, c.edges["e1"]):
            host, port = server.host, server.port
            # An Authorization header that is not UTF-8 (aiohttp hands it over as lone surrogates).
            for path in (b"/v1/objects/" + address, b"/v1/registry/manifests/public/doc"):
                status, _, body = await _raw(host, port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                             b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
                assert status == 401 and _error(body)["error"] == "unauthorized", (path, status, body)
            # A method the path does not take: 405 that names the ones it does.
            status, headers, body = await _raw(host, port, b"DELETE /v1/lookup HTTP/1.1\r\nHost: x\r\n"
                                               b"Connection: close\r\n\r\n")
            assert status == 405 and headers.get("allow") == "POST" and _error(body)["error"] == "method_not_allowed"
        # A JSON string that is a lone surrogate (an escape, or its bytes) is not text: 400, not a tokenizer crash.
        for field, raw in (("text", b'"\\ud800"'), ("prefix_text", b'"a\\udfff"'), ("text", b'"\xed\xa0\x80"')):
            doc = b'{"name": "s", "text": "ok", "' + field.encode() + b'": ' + raw + b"}"
            status, _, body = await _raw(c.origin.host, c.origin.port, b"POST /v1/publish HTTP/1.1\r\nHost: x\r\n"
                                         b"Authorization: Bearer " + PUBLISH.encode() + b"\r\nContent-Length: "
                                         + str(len(doc)).encode() + b"\r\nConnection: close\r\n\r\n" + doc)
            assert status == 400 and "lone surrogate" in _error(body)["detail"], (field, status, body)
        # A surrogate pair is one character, and fine.
        doc = b'{"addresses": ["' + address + b'"], "x": "\\ud83d\\ude00"}'
        e1 = c.edges["e1"]
        status, _, body = await _raw(e1.host, e1.port, b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: "
                                     b"Bearer " + EDGE_TOKEN.encode() + b"\r\nContent-Length: "
                                     + str(len(doc)).encode() + b"\r\nConnection: close\r\n\r\n" + doc)
        assert status == 200 and json.loads(body)["length"] == 1, body


def test_the_spec_and_the_server_agree_on_what_is_white_space():
    """Text fields must hold a character that is not white space: the server checks ``str.strip()``, the
    spec a character class. A character the two disagree on is valid input the server refuses (the fuzzer
    found '\\x0b' in an emphasis probe when the spec said only minLength 1)."""
    import re

    import yaml

    spec = yaml.safe_load(open(fuzz.SPEC))
    emphasis = spec["components"]["schemas"]["PublishRequest"]["properties"]["emphasis"]["properties"]
    patterns = {spec["components"]["schemas"]["Text"]["pattern"], emphasis["texts"]["items"]["pattern"],
                emphasis["probes"]["items"]["pattern"]}
    assert len(patterns) == 1
    pat = re.compile(patterns.pop())
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        assert bool(pat.search(c)) == bool(c.strip()), hex(cp)
