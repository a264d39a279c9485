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
