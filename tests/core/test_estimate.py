"""Source estimates: what they learn, and how they forget (so a source is measured again)."""

from kdn import estimate
from kdn.estimate import SourceEstimate


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
