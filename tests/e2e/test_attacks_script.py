"""bench/attacks.py's fast attacks, run as CI: a KDN of real processes, each attack played from outside.

The slow ones (a trickled head, a slow body: the real 30 s deadlines; stalled readers: 10 s) and the
rest are in the full run, whose table is in docs/security.md ("Attacks tried from outside").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_bench = str(Path(__file__).resolve().parents[2] / "bench")
if _bench not in sys.path:
    sys.path.insert(0, _bench)

import attacks  # noqa: E402  (bench/attacks.py)

# No skip when etcd is missing: CI installs it (.ci/run), and a skip would hide a lost install step.
pytestmark = pytest.mark.timeout(180)

FAST = ["bit_rot", "relabelled_namespace", "forged_record", "lying_body", "cold_stall", "planted_policy",
        "undone_policy", "rogue_node", "rogue_https_node", "lying_owner", "planted_digest", "manifest_rollback",
        "zstd_bomb", "cachegen_bomb", "hash_in_token", "bare_token", "tenant_cache_headers", "publish_body_unread",
        "malformed_json", "anonymous_probes", "oversize_record", "publish_push", "idle_connections",
        "client_content_length", "client_pooled_bytes", "console_quota_lift", "console_sign_in_flood"]  # (in bench/attacks.py's ATTACKS order: the rows come back in it)


async def test_the_fast_attacks_all_fail(tmp_path):
    names = FAST
    rows = await attacks.run(names, seed=11, tmp=tmp_path, quick=True)
    print(attacks.table(rows))
    assert [r.attack for r in rows] == names
    failed = {r.attack: r.got for r in rows if not r.ok}
    assert not failed, failed
    assert sum(r.wrong or 0 for r in rows) == 0
    by = {r.attack: r for r in rows}
    # each attack reached its target (else it proves nothing), and was turned away
    forged = by["forged_record"].figures
    assert forged["no_keys"]["forged"] > 0 and forged["kept_sig"]["forged"] == forged["resigned"]["forged"] == 0
    assert by["bit_rot"].figures["rotten_accepted_by_client"] == 0
    for bomb in ("zstd_bomb", "cachegen_bomb"):
        assert by[bomb].figures["outcome"].startswith("ObjectTooLarge") and by[bomb].figures["peak_growth_mib"] < 32
    for rogue in ("rogue_node", "rogue_https_node"):
        assert by[rogue].figures["requests"] > 0 and by[rogue].figures["authorization_headers"] == 0
    planted = by["planted_digest"].figures
    assert planted["planted_refused"] > 0 and planted["signed_forgeries"] == 0 and planted["forged"] == 0
