"""A locked-down etcd, as production runs it: TLS, client certificates, users with prefixes, expiring tokens.

The registry contract itself runs against such an etcd too (test_contract.py, ``etcd-secured``);
these tests are about who gets in, who does not, and what they are told.
"""

from __future__ import annotations

import asyncio

import pytest

from kdn.errors import RegistryError
from kdn.registry import Policy, open_registry


async def test_a_client_certificate_user_works_inside_its_prefix_only(secured_etcd):
    async with open_registry(secured_etcd.url("kdn", "/kdn-sec/a/")) as reg:
        await reg.put_policy(Policy(name="p", kind="pin", manifest="public/doc"))
        assert [p.name for p in await reg.list_policies()] == ["p"]
        watch = reg.watch("policies/")
        assert (await anext(watch)).kind == "snapshot"
        await reg.delete_policy("p")
        assert (await anext(watch)).kind == "delete"
        await watch.aclose()
    with pytest.raises(RegistryError, match="refused this client: etcdserver: permission denied") as e:
        async with open_registry(secured_etcd.url("kdn", "/elsewhere/")):
            pass
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["no client certificate", "certificate from another CA", "plaintext",
                                  "server not verified"])
async def test_who_cannot_get_in_is_told_in_one_line(secured_etcd, case):
    d, hp = secured_etcd.dir, secured_etcd.host_port
    url = {
        "no client certificate": f"etcds://{hp}/kdn-sec/?ca={d}/ca.pem",
        "certificate from another CA": f"etcds://{hp}/kdn-sec/?ca={d}/ca.pem&cert={d}/stranger.pem&key={d}/stranger.key",
        "plaintext": f"etcd://{hp}/kdn-sec/",
        "server not verified": f"etcds://{hp}/kdn-sec/?ca={d}/other-ca.pem&cert={d}/kdn.pem&key={d}/kdn.key",
    }[case]
    reg = open_registry(url)
    with pytest.raises(RegistryError) as e:
        await asyncio.wait_for(reg.__aenter__(), 20)  # refused, not hung
    await reg.close()
    assert str(e.value).startswith(f"etcd at {hp} ") and "\n" not in str(e.value)


async def test_a_user_and_password_over_tls(password_etcd, monkeypatch):
    d, hp = password_etcd.dir, password_etcd.host_port
    async with open_registry(f"etcds://kdn@{hp}/kdn-sec/b/?ca={d}/ca.pem&password_file={d}/kdn.password") as reg:
        await reg.put_policy(Policy(name="q", kind="pin", manifest="public/doc"))
    monkeypatch.setenv("KDN_ETCD_PASSWORD", "kdnpw")
    async with open_registry(f"etcds://kdn@{hp}/kdn-sec/b/?ca={d}/ca.pem") as reg:
        assert [p.name for p in await reg.list_policies()] == ["q"]
    with pytest.raises(RegistryError, match="refused this client: etcdserver: authentication failed"):
        async with open_registry(f"etcds://kdn@{hp}/kdn-sec/b/?ca={d}/ca.pem&password_file={d}/wrong.password"):
            pass
    monkeypatch.delenv("KDN_ETCD_PASSWORD")
    with pytest.raises(RegistryError, match="refused this client: etcdserver: user name is empty"):
        async with open_registry(f"etcds://{hp}/kdn-sec/b/?ca={d}/ca.pem"):
            pass


async def test_an_expired_token_is_renewed_and_watches_go_on(password_etcd):
    """etcd drops a simple token after --auth-token-ttl idle seconds (2 here, 300 by default); aetcd alone
    kept sending the dead one, so a quiet edge lost the registry for good."""
    d, hp = password_etcd.dir, password_etcd.host_port
    url = f"etcds://kdn@{hp}/kdn-sec/c/?ca={d}/ca.pem&password_file={d}/kdn.password"
    async with open_registry(url) as reg, open_registry(url) as writer:
        watch = reg.watch("policies/")
        assert (await anext(watch)).kind == "snapshot"
        first = reg._client.metadata
        await asyncio.sleep(3.5)  # both tokens expire
        await writer.put_policy(Policy(name="r", kind="pin", manifest="public/doc"))  # a fresh token, then the write
        ev = await asyncio.wait_for(anext(watch), 10)
        assert (ev.kind, ev.key) == ("put", "policies/r")
        assert [p.name for p in await reg.list_policies()] == ["r"]
        assert reg._client.metadata != first  # it did expire, and was renewed
        await watch.aclose()
