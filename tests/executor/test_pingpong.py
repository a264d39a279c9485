"""The one ping-pong timer (executor.pingpong): when it synchronises CUDA, and what it times, checked with a fake
transport, a fake clock and a fake CUDA wait (no GPU here). A real two-process ping-pong runs in
tests/profiles/test_p2p.py, through profiles.p2p, which times with this module."""

import types

import pytest
import torch

from executor import pingpong
from executor.pingpong import round_trip, round_trip_times, synchronizer


@pytest.fixture
def events(monkeypatch):
    """The calls the timer makes, in order: ``send``/``recv`` with the peer, ``sync``, and ``clock`` readings,
    which return 1.0, 2.0, 3.0, ... s (so a reading's value says when it was taken)."""
    log = []
    clock = iter(float(k) for k in range(1, 10_000))

    def perf_counter():
        log.append("clock")
        return next(clock)

    monkeypatch.setattr(pingpong, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(torch.distributed, "send", lambda m, dst, group=None: log.append(("send", dst, id(m))))
    monkeypatch.setattr(torch.distributed, "recv", lambda m, src, group=None: log.append(("recv", src, id(m))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", str(device))))
    return log


def _fake_cuda_message(index=1):
    """Stands for a tensor on ``cuda:index`` (the timer reads only its device; the transport is fake)."""
    return types.SimpleNamespace(device=torch.device("cuda", index))


def test_only_a_cuda_device_is_synchronised():
    calls = []
    wait = synchronizer(torch.device("cuda", 3), cuda_synchronize=calls.append)
    assert wait is not None
    wait()
    assert calls == [torch.device("cuda", 3)]  # the message's own device, not the current one
    assert synchronizer(torch.device("cpu"), cuda_synchronize=calls.append) is None
    assert calls == [torch.device("cuda", 3)]


def test_a_cuda_round_trip_is_bracketed_by_synchronisation(events):
    message = _fake_cuda_message(1)
    start, end = round_trip(message, 1, initiate=True)
    m = id(message)
    # Wait for queued work, read the clock, send and receive (which NCCL only enqueues), wait, read the clock.
    assert events == [("sync", "cuda:1"), "clock", ("send", 1, m), ("recv", 1, m), ("sync", "cuda:1"), "clock"]
    assert (start, end) == (1.0, 2.0)


def test_the_answering_side_reads_its_hook_after_the_message_has_arrived(events):
    message = _fake_cuda_message(0)
    arrived = []
    round_trip(message, 0, initiate=False, on_arrival=lambda msg: arrived.append(len(events)))
    m = id(message)
    assert events == [("sync", "cuda:0"), "clock", ("recv", 0, m), ("sync", "cuda:0"), ("send", 0, m),
                      ("sync", "cuda:0"), "clock"]
    assert arrived == [4]  # after the receive and its wait, before the answer is sent


def test_a_cpu_round_trip_waits_for_nothing(events):
    message = torch.zeros(4)
    round_trip(message, 1, initiate=False, on_arrival=lambda msg: events.append("hook"))
    round_trip(message, 1, initiate=True, on_arrival=lambda msg: events.append("never on the initiating side"))
    m = id(message)
    assert events == ["clock", ("recv", 1, m), "hook", ("send", 1, m), "clock",
                      "clock", ("send", 1, m), ("recv", 1, m), "clock"]


def test_round_trips_interleave_the_messages_and_keep_only_the_timed_rounds(events):
    small, large = torch.zeros(1), torch.zeros(8)
    times = round_trip_times([small, large], 1, initiate=True, warmup=2, repeats=3)
    sends = [e[2] for e in events if e[0] == "send"]
    assert sends == [id(small), id(large)] * 5  # every round visits each message once
    # Each trip takes two readings one apart on the fake clock; the warm-up rounds' trips are dropped.
    assert times == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert events.count("clock") == 2 * 2 * 5


def test_round_trips_of_a_cuda_tensor_synchronise_every_trip(events):
    times = round_trip_times([_fake_cuda_message(2)], 0, initiate=False, warmup=0, repeats=2)
    assert events.count(("sync", "cuda:2")) == 2 * 2 and len(times[0]) == 2


@pytest.mark.parametrize("warmup, repeats", [(0, 0), (-1, 3)])
def test_round_trip_times_rejects_no_timed_round_or_a_negative_warmup(warmup, repeats):
    with pytest.raises(ValueError, match="repeats >= 1 and warmup >= 0"):
        round_trip_times([torch.zeros(1)], 1, initiate=True, warmup=warmup, repeats=repeats)
