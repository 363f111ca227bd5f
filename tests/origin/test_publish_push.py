"""A publish that asks for a push (#29 item 4): ``push`` and ``push_rate`` in the publish body, checked at the
boundary; the origin's push policy itself is exercised end to end in tests/edge/test_push.py."""

from __future__ import annotations

import pytest

from kdn.adapters.hf import ByteTokenizer
from kdn.errors import InvalidInput
from kdn.origin.publish import MAX_PUSH_REGIONS, parse_request, push_policy, push_policy_name

TOK = ByteTokenizer()


def parse(**fields):
    body = {"name": "tide", "text": "The tide tables are posted at the harbour office.", **fields}
    return parse_request(body, tokenizer=TOK, vocab_size=TOK.vocab_size, max_tokens=4096)


def test_a_push_names_its_regions_sorted_once_each_or_every_region():
    spec = parse(push=["us", "eu", "us"], push_rate=1 << 20)
    assert spec.push == ("eu", "us") and spec.push_rate == 1 << 20
    p = push_policy(spec)
    assert (p.name, p.kind, p.manifest, p.extra) == ("push.public.tide", "push", "public/tide",
                                                     {"regions": ["eu", "us"], "rate_bytes": 1 << 20})
    every = push_policy(parse(push=True))
    assert every.extra == {} and every.manifest == "public/tide"  # no regions: every one (as the CLI's --push)
    assert parse().push is None and parse(push=False).push is False  # absent: leave a push as is; false: end it


def test_a_long_name_gets_a_policy_name_that_still_fits():
    name = push_policy_name("a" * 63, "b" * 128)
    assert name.startswith("push.") and len(name) <= 128
    assert name == push_policy_name("a" * 63, "b" * 128) != push_policy_name("a" * 63, "c" * 128)


@pytest.mark.parametrize("fields, match", [
    ({"push": "eu"}, "'push' must be"),
    ({"push": []}, "'push' must be"),
    ({"push": ["eu"] * (MAX_PUSH_REGIONS + 1)}, "'push' must be"),
    ({"push": ["../eu"]}, "invalid"),
    ({"push": [3]}, "invalid"),
    ({"push_rate": 1000}, "goes with 'push'"),
    ({"push": True, "push_rate": 0}, "positive integer"),
    ({"push": True, "push_rate": True}, "positive integer"),
    ({"push": True, "push_rate": 1.5}, "positive integer"),
])
def test_a_bad_push_is_refused_before_anything_is_computed(fields, match):
    with pytest.raises(InvalidInput, match=match):
        parse(**fields)
