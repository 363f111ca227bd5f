"""Grants: parsing token files, and what a bearer token may do (401 vs 403)."""

from __future__ import annotations

import pytest

from kdn.auth import ANY, ROLES, AuthError, Grant, Grants
from kdn.errors import InvalidInput, KDNError

PUB = "p" * 16 + "-publisher"
READER = "r" * 16 + "-reader"
ADMIN = "a" * 16 + "-admin"
ALL = "x" * 32

TOKEN_FILE = f"""
# token                          roles            namespaces
{PUB}   publish,read   public,acme   # the acme publisher
{READER}    read           acme

{ADMIN}   admin   *
"""


def bearer(token: str) -> str:
    return f"Bearer {token}"


@pytest.fixture
def grants() -> Grants:
    return Grants.parse(TOKEN_FILE)


def status_of(grants: Grants, authorization: str | None, role: str, namespace: str) -> int:
    with pytest.raises(AuthError) as e:
        grants.check(authorization, role, namespace)
    return e.value.status


# --- parse -----------------------------------------------------------------------


def test_admin_star_grants_every_role_everywhere():
    g = Grants.parse(f"{ALL} admin *\n")
    for role in ROLES:
        for ns in ("public", "acme", "z"):
            assert g.check(bearer(ALL), role, ns) == Grant(frozenset({"admin"}), frozenset({ANY}))
    assert g.namespaces(bearer(ALL), "publish") == {ANY}


def test_roles_and_namespaces_lines(grants):
    assert grants.check(bearer(PUB), "publish", "acme").roles == {"publish", "read"}
    assert grants.check(bearer(PUB), "read", "public").namespaces == {"public", "acme"}
    assert grants.check(bearer(READER), "read", "acme") == Grant(frozenset({"read"}), frozenset({"acme"}))


def test_comments_and_blank_lines_are_ignored():
    g = Grants.parse("# only comments\n\n   \n  # indented comment\n")
    assert g.empty
    g = Grants.parse(f"{ALL} admin *  # trailing comment\n")
    assert not g.empty
    assert g.check(bearer(ALL), "admin", "public")


def test_empty_text_is_empty():
    assert Grants.parse("").empty
    assert Grants().empty


@pytest.mark.parametrize(
    "line, says",
    [
        (f"{ALL} read,write public", "unknown role(s) ['write']"),
        (f"{ALL} Read public", "unknown role(s) ['Read']"),
        (f"{ALL} read", "expected 'TOKEN ROLES NAMESPACES'"),
        (f"{ALL} read public extra", "expected 'TOKEN ROLES NAMESPACES'"),
        (ALL, "a token alone grants nothing; write 'TOKEN admin *'"),
        ("short read *", "at least 16 characters"),
        ("x" * 15 + " read public", "at least 16 characters"),
    ],
)
def test_bad_line_names_its_line_number(line, says):
    text = f"# header\n\n{ALL.upper()} admin *\n{line}\n"
    with pytest.raises(InvalidInput) as e:
        Grants.parse(text)
    assert "line 4" in str(e.value)
    assert says in str(e.value)


def test_token_of_exactly_16_characters_is_accepted():
    g = Grants.parse("y" * 16 + " read public")
    assert g.check(bearer("y" * 16), "read", "public")


@pytest.mark.parametrize("namespace", ["Acme", "a/b", "..", "-x", "x" * 64])
def test_bad_namespace_is_invalid_input(namespace):
    with pytest.raises(InvalidInput, match="invalid namespace"):
        Grants.parse(f"{ALL} read public,{namespace}")


def test_bad_namespace_error_names_the_line():
    # Bug (kdn/auth.py, Grants.parse): a bad namespace is reported by
    # validate_namespace's own message, without the "token file line N: "
    # prefix every other bad line gets, so the operator cannot find the line.
    with pytest.raises(InvalidInput) as e:
        Grants.parse(f"# header\n{ALL.upper()} admin *\n{ALL} read Not/A/Namespace\n")
    assert "line 3" in str(e.value)


def test_from_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    g = Grants.from_file(path)
    assert g.check(bearer(READER), "read", "acme")
    assert Grants.from_file(None).empty
    with pytest.raises(InvalidInput, match="cannot read token file"):
        Grants.from_file(tmp_path / "missing")


# --- check: 401 ------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, ""])
def test_missing_token_is_401(grants, authorization):
    assert status_of(grants, authorization, "read", "public") == 401


@pytest.mark.parametrize(
    "authorization",
    [
        f"Basic {PUB}",
        PUB,  # no scheme
        "Bearer",
        "Bearer ",
        "Bearer    ",
        f"Token {PUB}",
    ],
)
def test_malformed_authorization_is_401(grants, authorization):
    assert status_of(grants, authorization, "read", "public") == 401


@pytest.mark.parametrize("token", ["z" * 32, PUB + "x", PUB[:-1], PUB.upper()])
def test_unknown_token_is_401(grants, token):
    assert status_of(grants, bearer(token), "read", "public") == 401


def test_bearer_scheme_is_case_insensitive_and_token_trimmed(grants):
    assert grants.check(f"bearer {READER}", "read", "acme")
    assert grants.check(f"BEARER {READER}  ", "read", "acme")


def test_auth_error_is_a_kdn_error():
    assert issubclass(AuthError, KDNError)
    assert AuthError("x", status=403).status == 403


# --- check: 403 ------------------------------------------------------------------


def test_token_lacking_the_role_is_403(grants):
    assert status_of(grants, bearer(READER), "publish", "acme") == 403
    assert status_of(grants, bearer(PUB), "admin", "acme") == 403


def test_token_lacking_the_namespace_is_403(grants):
    assert status_of(grants, bearer(READER), "read", "public") == 403
    assert status_of(grants, bearer(PUB), "publish", "other") == 403


def test_admin_implies_every_role(grants):
    for role in ("read", "publish", "admin"):
        assert grants.check(bearer(ADMIN), role, "anything")


def test_admin_is_still_bound_to_its_namespaces():
    g = Grants.parse(f"{ADMIN} admin acme")
    assert g.check(bearer(ADMIN), "publish", "acme")
    assert status_of(g, bearer(ADMIN), "read", "public") == 403


# --- anonymous ---------------------------------------------------------------------

OPEN = Grant(frozenset({"read"}), frozenset({"public"}))


def test_anonymous_grant_applies_without_a_token():
    g = Grants.parse(TOKEN_FILE, anonymous=OPEN)
    assert g.check(None, "read", "public") is OPEN
    assert g.check("", "read", "public") is OPEN
    # Beyond the anonymous grant, a caller without a token is asked for one (401), not refused (403).
    assert status_of(g, None, "read", "acme") == 401
    assert status_of(g, None, "publish", "public") == 401
    assert status_of(g, "", "publish", "public") == 401


def test_anonymous_grant_does_not_excuse_a_bad_token():
    g = Grants.parse(TOKEN_FILE, anonymous=OPEN)
    assert status_of(g, bearer("z" * 32), "read", "public") == 401
    assert status_of(g, "Basic abc", "read", "public") == 401


def test_without_anonymous_grant_no_token_is_401_even_with_no_token_file():
    assert status_of(Grants(), None, "read", "public") == 401
    g = Grants(anonymous=OPEN)
    assert g.empty and g.check(None, "read", "public") is OPEN


# --- namespaces ------------------------------------------------------------------


def test_namespaces(grants):
    assert grants.namespaces(bearer(PUB)) == {"public", "acme"}
    assert grants.namespaces(bearer(PUB), "publish") == {"public", "acme"}
    assert grants.namespaces(bearer(READER)) == {"acme"}
    assert grants.namespaces(bearer(READER), "publish") == frozenset()
    assert grants.namespaces(bearer(ADMIN), "publish") == {ANY}
    assert grants.namespaces(None) == frozenset()


def test_namespaces_of_anonymous_caller():
    g = Grants.parse(TOKEN_FILE, anonymous=OPEN)
    assert g.namespaces(None) == {"public"}
    assert g.namespaces(None, "publish") == frozenset()


def test_namespaces_of_unknown_token_is_401(grants):
    with pytest.raises(AuthError) as e:
        grants.namespaces(bearer("z" * 32))
    assert e.value.status == 401


def test_a_hash_inside_a_token_is_refused_not_read_as_a_comment():
    # Once, 'abc#def publish acme' was cut at '#' to a bare token: every role on every namespace.
    with pytest.raises(InvalidInput, match="token file line 1"):
        Grants.parse("tenant-token-0123#456 publish acme\n")
    g = Grants.parse("tenant-token-0123456 publish acme  # a comment after whitespace\n# a whole-line comment\n")
    grant = g.lookup("Bearer tenant-token-0123456")
    assert grant is not None and grant.allows("publish", "acme") and not grant.allows("publish", "public")


def test_a_bare_token_line_grants_nothing_it_is_refused():
    """A bare token once granted every role on every namespace: a line that lost its fields (a stray '#', a bad
    edit) became the file's most powerful grant. Everything a line grants is now written on it."""
    with pytest.raises(InvalidInput, match="line 2: a token alone grants nothing; write 'TOKEN admin \\*'"):
        Grants.parse(f"{PUB} publish public\n{READER}   # the reader, roles to follow\n")


def test_read_token_takes_the_first_field_of_a_grants_file(tmp_path):
    from kdn.auth import read_token

    path = tmp_path / "tokens"
    path.write_text(f"# who\n{PUB} publish,read public  # publisher\n{READER} read acme\n")
    assert read_token(str(path)) == PUB
    path.write_text("tenant-token-0123#456 read *\n")  # no silent truncation at a '#' inside a token
    assert read_token(str(path)) == "tenant-token-0123#456"


def test_tokens_are_a_charset_not_any_bytes():
    for bad in ("tok\u00e9n-0123456789abc read *", "tok'en-0123456789abc read *"):
        with pytest.raises(InvalidInput, match="a token is made of"):
            Grants.parse(bad)


def test_a_token_on_two_lines_is_refused_not_resolved_by_order():
    """Two lines for one token once meant the last one silently won (a narrowed grant undone by a stray line)."""
    with pytest.raises(InvalidInput, match="line 3: the token of line 1 again"):
        Grants.parse(f"{READER} read acme\n{PUB} publish public\n{READER} admin *\n")


def test_a_world_readable_token_file_is_warned_about(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    path.chmod(0o640)
    Grants.from_file(path)
    assert "readable by every user" not in caplog.text
    path.chmod(0o644)
    Grants.from_file(path)
    assert "readable by every user" in caplog.text and "chmod o-r" in caplog.text


def test_model_level_objects_are_readable_with_any_read_grant_and_only_they():
    from kdn.auth import may_read

    acme = frozenset({"acme"})
    assert may_read(acme, "public", "basis")  # a kvtc basis, recorded by an origin in public
    assert not may_read(acme, "public", "kv") and not may_read(acme, "beta", "kv")
    assert not may_read(acme, "beta", "basis")  # only public ones: a basis elsewhere stays its namespace's
    assert not may_read(frozenset(), "public", "basis")  # no read grant at all: nothing
    assert may_read(frozenset({"*"}), "beta", "kv") and may_read(acme, "acme", "kv")


# --- where a node's token may go (issue #28, item 2) ---------------------------------------------------------


def test_an_https_node_record_outside_the_token_hosts_gets_no_token():
    """A rogue node record at https://, with a certificate from any CA the edge trusts, once got the edge's
    ``read *`` token whatever --token-hosts said: https proves a name, not the operator's intent."""
    from kdn.auth import TokenScope

    scope = TokenScope("127.0.0.1,origin")
    assert not scope.allows("https://127.0.0.2:8443")
    assert not scope.allows("https://rogue.example")
    assert scope.allows("https://127.0.0.1:8443") and scope.allows("http://origin:8000")


@pytest.mark.parametrize("host, allowed", [
    ("edge-eu-1", True), ("EDGE-eu-1", True), ("edge-eu-1.", True),
    ("edge-1.attacker.example", False),  # fnmatch over the whole host once matched this, over plain http
    ("x.edge-1", False), ("origin", True), ("origin.attacker.example", False),
])
def test_a_token_host_glob_matches_one_label_at_a_time(host, allowed):
    from kdn.auth import TokenScope

    assert TokenScope("origin,edge-*").allows(f"http://{host}:8100") is allowed


@pytest.mark.parametrize("host, allowed", [
    ("edge-0.kdn-edge-eu-peers.default.svc.cluster.local", True), ("kdn-origin.default.svc.cluster.local", True),
    ("default.svc.cluster.local", False), ("evil.default.svc.cluster.local.attacker.example", False),
    ("edge-0.other.svc.cluster.local", False),
])
def test_a_leading_double_star_stands_for_any_labels(host, allowed):
    from kdn.auth import TokenScope

    assert TokenScope("**.default.svc.cluster.local").allows(f"https://{host}") is allowed


@pytest.mark.parametrize("bad", ["**", "a.**.b", "a..b", ".a", "a b"])
def test_bad_token_host_patterns_fail_in_one_line(bad):
    from kdn.auth import TokenScope

    with pytest.raises(InvalidInput, match="token host pattern"):
        TokenScope([bad])


def test_the_default_token_hosts_are_loopback_only():
    from kdn.auth import TokenScope

    scope = TokenScope()
    assert scope.allows("http://127.0.0.2:1") and scope.allows("https://localhost:1") and scope.allows("http://[::1]:1")
    assert not scope.allows("https://example.com") and not scope.allows("ftp://127.0.0.1")
