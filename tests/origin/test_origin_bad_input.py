"""Bad input gets a clear 4xx JSON error and changes nothing; objects are served with the right headers."""

from __future__ import annotations

import pytest

from origin_records import open_records  # bench/lib/origin_records.py

from origin_helpers import PUBLISH_TOKEN, READ_ALL, TENANT_TOKEN, auth, publish, running_origin

GOOD = {"name": "doc", "namespace": "public", "text": "hello world " * 30}


async def assert_nothing_changed(tmp_path, etcd_url):
    assert not list((tmp_path / "store").rglob("*.zstd")), "a rejected publish stored objects"
    reg = open_records(etcd_url, tmp_path / "store")
    try:
        assert await reg.list_manifests() == []
        assert [k for k, _ in await reg.list_keys("objects/")] == []
    finally:
        await reg.close()


@pytest.mark.parametrize(
    "headers,body,status,code",
    [
        ({}, GOOD, 401, "unauthorized"),
        (auth("wrong-token-0000000000000"), GOOD, 401, "unauthorized"),
        ({"Authorization": "Basic abc"}, GOOD, 401, "unauthorized"),
        (auth(TENANT_TOKEN), GOOD, 403, "forbidden"),  # acme's token may not publish to public
        (auth(READ_ALL), GOOD, 403, "forbidden"),  # a read-only token may not publish
        (auth(PUBLISH_TOKEN), {**GOOD, "text": "   "}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "text": None}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "tokens": [1, 2, 3]}, 400, "bad_request"),  # text and tokens
        (auth(PUBLISH_TOKEN), {"name": "t", "tokens": [1, -2]}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {"name": "t", "tokens": [10**9]}, 400, "bad_request"),  # past the vocabulary
        (auth(PUBLISH_TOKEN), {**GOOD, "text": "x" * 5000}, 400, "bad_request"),  # longer than the context
        (auth(PUBLISH_TOKEN), {**GOOD, "namespace": "../etc"}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "name": "a/b"}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "name": ""}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "template": "chat"}, 400, "bad_request"),  # tiny model: no chat template
        (auth(PUBLISH_TOKEN), {**GOOD, "template": "nope"}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "encodings": ["int7"]}, 400, "bad_request"),
        (auth(PUBLISH_TOKEN), {**GOOD, "prefix": False}, 400, "bad_request"),
    ],
)
async def test_bad_publish_is_rejected_and_changes_nothing(tmp_path, etcd_url, headers, body, status, code):
    async with running_origin(tmp_path, etcd_url) as (server, session):
        body = {k: v for k, v in body.items() if v is not None}
        async with session.post("/v1/publish", json=body, headers=headers) as r:
            assert r.status == status, await r.text()
            err = await r.json()
        assert err["error"] == code and err["detail"] and "Traceback" not in err["detail"]
    await assert_nothing_changed(tmp_path, etcd_url)


async def test_malformed_and_oversized_bodies(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url, max_body_bytes=1 << 16) as (server, session):
        async with session.post("/v1/publish", data=b"{not json", headers=auth(PUBLISH_TOKEN)) as r:
            assert r.status == 400 and (await r.json())["error"] == "bad_request"
        async with session.post("/v1/publish", data=b"[1,2]", headers=auth(PUBLISH_TOKEN)) as r:
            assert r.status == 400
        big = b'{"name": "big", "text": "' + b"a" * (1 << 17) + b'"}'
        async with session.post("/v1/publish", data=big, headers=auth(PUBLISH_TOKEN)) as r:
            assert r.status == 413 and (await r.json())["error"] == "too_large"
    await assert_nothing_changed(tmp_path, etcd_url)


async def test_unknown_model_fails_startup_with_a_clear_error(tmp_path, etcd_url):
    from kdn.errors import UnknownModel

    with pytest.raises(UnknownModel, match="tiny-llama"):
        async with running_origin(tmp_path, etcd_url, model="no-such-model"):
            pass


async def test_object_endpoint_headers_conditional_and_errors(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url) as (server, session):
        m = (await publish(session, GOOD))["manifest"]
        a = m["addresses"][0]
        async with session.get(f"/v1/objects/{a}") as r:  # public: anonymous read is allowed
            assert r.status == 200
            etag, body = r.headers["ETag"], await r.read()
            assert "immutable" in r.headers["Cache-Control"] and r.headers["X-KDN-Source"] == "origin:origin-test"
        async with session.head(f"/v1/objects/{a}") as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) == len(body) and r.headers["ETag"] == etag
        async with session.get(f"/v1/objects/{a}", headers={"If-None-Match": etag}) as r:
            assert r.status == 304
        async with session.get("/v1/objects/" + "0" * 64) as r:
            assert r.status == 404 and (await r.json())["error"] == "not_found"
        async with session.get("/v1/objects/NOT-AN-ADDRESS") as r:
            assert r.status == 400 and (await r.json())["error"] == "bad_request"
        async with session.get(f"/v1/registry/objects/{a}") as r:
            assert r.status == 200 and (await r.json())["address"] == a
        async with session.get("/v1/registry/manifests/public/doc") as r:
            assert r.status == 200 and (await r.json())["addresses"] == m["addresses"]
        async with session.post("/v1/lookup", json={"addresses": m["addresses"] + ["1" * 64]}) as r:
            assert (await r.json())["length"] == len(m["addresses"])
        async with session.get("/healthz") as r:
            assert (await r.json())["status"] == "ok"
        async with session.get("/metrics") as r:
            text = await r.text()
            assert "kdn_origin_chunks_computed_total" in text and "kdn_http_requests_total" in text


async def test_tenant_objects_are_invisible_to_other_tenants(tmp_path, etcd_url):
    async with running_origin(tmp_path, etcd_url) as (server, session):
        job = await publish(session, {**GOOD, "namespace": "acme"}, token=TENANT_TOKEN)
        a = job["manifest"]["addresses"][0]
        for headers in ({}, auth(PUBLISH_TOKEN.replace("a", "z"))):
            async with session.get(f"/v1/objects/{a}", headers=headers) as r:
                assert r.status in (401, 404)
        async with session.get(f"/v1/objects/{a}") as r:
            assert r.status == 404  # anonymous: same answer as for an address that does not exist
        async with session.get("/v1/registry/manifests/acme/doc") as r:
            assert r.status == 404
        async with session.post("/v1/lookup", json={"addresses": [a]}) as r:
            assert (await r.json())["length"] == 0
        for token in (TENANT_TOKEN, READ_ALL):
            async with session.get(f"/v1/objects/{a}", headers=auth(token)) as r:
                assert r.status == 200
