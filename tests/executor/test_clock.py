"""Clock offsets: Cristian's estimate against exchanges built from a known offset."""

import pytest

from executor.clock import offset_from_exchanges, shares_host_clock


def test_symmetric_exchange_recovers_offset_exactly():
    offset, leg = 3.25, 0.002  # rank r's clock is 3.25 s behind rank 0's; each leg takes 2 ms
    t0 = 100.0
    exchanges = [(t0, t0 + leg - offset, t0 + 2 * leg)]
    result = offset_from_exchanges(exchanges)
    assert result.offset_s == pytest.approx(offset, abs=1e-12)
    assert result.uncertainty_s == pytest.approx(leg)


def test_shortest_round_trip_wins_and_bounds_the_error():
    offset = -0.5
    # A slow exchange whose return leg queued 40 ms would be off by 20 ms; the fast one is exact.
    slow = (10.0, 10.001 - offset, 10.042)
    fast = (11.0, 11.0005 - offset, 11.001)
    result = offset_from_exchanges([slow, fast])
    assert result.offset_s == pytest.approx(offset, abs=1e-12)
    assert abs(offset_from_exchanges([slow]).offset_s - offset) <= offset_from_exchanges([slow]).uncertainty_s


@pytest.mark.parametrize("bad", [[], [(2.0, 1.0, 1.0)]])
def test_bad_exchanges_are_rejected(bad):
    with pytest.raises(ValueError):
        offset_from_exchanges(bad)


def test_only_the_same_host_shares_a_clock():
    assert not shares_host_clock("a", "b")
    import sys

    assert shares_host_clock("a", "a") == sys.platform.startswith("linux")


def _two_hosts(monkeypatch):
    """Rank 0 on host ``a``, rank 1 on host ``b``: their clocks must be estimated."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None),
                                                                                                ["a", "b"]))


def test_rank_zero_estimates_the_offset_from_the_answers_reading(monkeypatch):
    # A fake transport whose answer carries rank 1's clock, 100 s behind rank 0's, read halfway through each trip.
    import types

    import torch.distributed as dist

    from executor import clock, pingpong

    _two_hosts(monkeypatch)
    readings = iter([10.0, 10.004, 20.0, 20.002])  # (t0, t1) of two exchanges on rank 0's clock, s
    answers = iter([10.002 - 100.0, 20.001 - 100.0])
    monkeypatch.setattr(pingpong, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    monkeypatch.setattr(dist, "send", lambda m, dst, group=None: None)
    monkeypatch.setattr(dist, "recv", lambda m, src, group=None: m.fill_(next(answers)))
    offsets = clock.measure_offsets(0, 2, rounds=2)
    assert offsets[0] == clock.ClockOffset(0.0, 0.0)
    assert offsets[1].offset_s == pytest.approx(100.0, abs=1e-9)
    assert offsets[1].uncertainty_s == pytest.approx(0.001, abs=1e-9)  # the shorter trip's half


def test_the_answering_rank_sends_its_clock_read_after_the_message_arrived(monkeypatch):
    import types

    import torch.distributed as dist

    from executor import clock

    _two_hosts(monkeypatch)
    log = []
    fake_time = types.SimpleNamespace(perf_counter=lambda: float(len(log)), get_clock_info=clock.time.get_clock_info)
    monkeypatch.setattr(clock, "time", fake_time)
    monkeypatch.setattr(dist, "recv", lambda m, src, group=None: log.append(("recv", src)))
    monkeypatch.setattr(dist, "send", lambda m, dst, group=None: log.append(("send", dst, m.item())))
    assert clock.measure_offsets(1, 2, rounds=1) == []
    assert log == [("recv", 0), ("send", 0, 1.0)]  # read when one event (the receive) had happened
