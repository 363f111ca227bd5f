"""Source estimates: what they learn, and how they forget (so a source is measured again)."""

from kdn.wire import estimate
from kdn.wire.estimate import SourceEstimate


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_samples_then_staleness_bring_back_the_prior(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(estimate.time, "monotonic", clock)
    e = SourceEstimate()
    e.set_prior(0.001)
    e.observe(1000, 0.2)  # a small transfer: an RTT sample
    assert abs(e.expected(0) - 0.2) < 1e-9
    clock.t += e.stale_after + 1
    assert abs(e.expected(0) - 0.001) < 1e-9  # not sampled for a while: explored again at its prior


def test_a_failure_penalizes_until_it_is_old(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(estimate.time, "monotonic", clock)
    e = SourceEstimate()
    e.set_prior(0.001)
    e.fail()
    e.fail()
    assert e.expected(0) >= 0.1  # 0.05 doubled: a failing source falls behind
    clock.t += e.stale_after - 1
    assert e.expected(0) >= 0.1
    clock.t += 2  # the last failure is older than stale_after: forgiven, so the source is asked again
    assert abs(e.expected(0) - 0.001) < 1e-9
    e.fail()  # and a new failure starts over from the doubled penalty it had
    assert e.expected(0) >= 0.2


# --- decode speeds: the receiver's half of choosing an encoding --------------------------------------------


def test_decode_speed_starts_at_the_table_then_follows_what_is_measured():
    from kdn.format.encodings import TABLE
    from kdn.wire.estimate import MIN_DECODE_SAMPLE, DecodeSpeeds

    d = DecodeSpeeds(alpha=0.5)
    assert d.rate("zstd") == TABLE["zstd"].decode_mbps * 1e6  # never timed here: the table's figure
    d.observe("zstd", MIN_DECODE_SAMPLE - 1, 1e-6)  # too small to be a speed sample
    assert d.rate("zstd") == TABLE["zstd"].decode_mbps * 1e6
    d.observe("zstd", 100_000_000, 1.0)  # 100 MB/s measured: replaces the prior at once
    assert d.rate("zstd") == 100e6
    d.observe("zstd", 300_000_000, 1.0)  # then an average
    assert d.rate("zstd") == 200e6
    assert abs(d.seconds("zstd", 1_000_000) - 1_000_000 * TABLE["zstd"].ratio / 200e6) < 1e-12
    assert d.snapshot() == {"zstd": {"mbps": 200.0, "samples": 2}}
    d.observe("zstd", 1 << 20, 0.0)  # a zero duration is no sample
    assert d.snapshot()["zstd"]["samples"] == 2


def test_the_same_fast_link_picks_raw_for_a_slow_receiver_and_zstd_for_a_fast_one():
    from kdn.client import KDNClient
    from kdn.registry.records import Encoding
    from kdn.wire.estimate import DecodeSpeeds

    # one 2k chunk of SmolLM2, bf16
    encodings = {"raw": Encoding("raw", 47_185_920, "0" * 64), "zstd": Encoding("zstd", 32_540_000, "0" * 64)}

    def choice(link_bps: float, zstd_decode_bps: float) -> str | None:
        speeds = DecodeSpeeds()
        speeds.observe("raw", 47_185_920, 47_185_920 / 10e9)  # a copy at 10 GB/s
        speeds.observe("zstd", 47_185_920, 47_185_920 / zstd_decode_bps)
        client = KDNClient(edges=["http://127.0.0.1:9"], decode_speeds=speeds)
        est = client.routing.estimates["http://127.0.0.1:9"]
        est.bandwidth, est.rtt = link_bps, 0.001
        return client.choose_encoding(encodings)

    # 2 GB/s of loopback: a 0.4 GB/s decode costs more than the extra raw bytes; a 20 GB/s one does not
    assert choice(2e9, 0.4e9) == "raw"
    assert choice(2e9, 20e9) == "zstd"
    # a 100 MB/s WAN link: zstd's 1.45x fewer bytes win even with the slow decode
    assert choice(100e6, 0.4e9) == "zstd"


def test_a_client_times_its_decodes_into_its_speeds():
    """``decode_checked`` (every fetch_prefix decode) feeds the client's DecodeSpeeds."""
    from kdn.format import address as A
    from kdn.client.checked import decode_checked
    from kdn.client import Fetched, Lookup
    from kdn.wire.estimate import DecodeSpeeds
    from kdn.format.objects import RawTensor, encode_object

    model = A.model_id(architecture="t", dtype="U8", config_fields={}, weights_digest="0" * 64,
                       tokenizer_digest="0" * 64)
    addr = A.prefix_addresses(model, "public", list(range(256)), 256)[0]
    data = bytes(range(256)) * 4096  # 1 MiB: a speed sample
    blob = encode_object(kind="kv", address=addr, model_id=model, namespace="public", start=0, end=256,
                         position=0, parent=None, encoding="zstd",
                         tensors={"L0.k": RawTensor("L0.k", "U8", (len(data),), memoryview(data))})
    hit = Lookup(model_id=model, namespace="public", addresses=[addr], tokens=256, chunk_tokens=256)
    speeds = DecodeSpeeds()
    decode_checked(Fetched(addr, "zstd", memoryview(blob), "edge", 0.0), hit, None, speeds=speeds)
    assert speeds.snapshot()["zstd"]["samples"] == 1 and speeds.rate("zstd") > 0


def test_company_is_the_average_number_in_flight_while_a_transfer_ran(monkeypatch):
    t = [0.0]
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: t[0])
    c = estimate.Company()
    a = c.start("s")  # alone for 1 s, then with b for 1 s: 1.5 on average
    t[0] = 1.0
    b = c.start("s")
    other = c.start("elsewhere")  # another source is not company
    t[0] = 2.0
    assert c.end(a) == 1.5 and c.end(a) == 1.5  # (counted once)
    t[0] = 4.0
    assert abs(c.end(b) - 4 / 3) < 1e-9  # 1 s with a, 2 s alone
    assert c.end(other) == 1.0 and c._n == {"s": 0, "elsewhere": 0}


def test_a_load_of_transfers_side_by_side_is_expected_at_their_sum(monkeypatch):
    """Eight transfers at once each saw an eighth of the link: one object is expected at that share (ranking,
    hedging), a load of many at the sum (the planner's link). Stale, both fall back to the prior."""
    clock = Clock()
    monkeypatch.setattr(estimate.time, "monotonic", clock)
    e = SourceEstimate()
    e.set_prior(0.02)  # rtt 20 ms
    e.observe(8 << 20, 0.02 + 0.5, company=8.0)  # 8 MiB in 0.5 s of transfer beside 7 others
    assert abs(e.bandwidth - (8 << 20) / 0.5) < 1 and abs(e.aggregate - 8 * (8 << 20) / 0.5) < 1
    assert e.expected(64 << 20) > 7 * e.expected_load(64 << 20) / 1.2
    assert e.expected_load(1000) <= e.expected(1000)
    clock.t += e.stale_after + 1
    assert e.expected_load(64 << 20) == e.expected(64 << 20)
