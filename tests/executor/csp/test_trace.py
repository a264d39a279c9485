"""``executor.csp.trace``: the ranks' spans on one clock, each transfer on the wire from its post to its arrival."""

from executor.csp.trace import csp_trace
from sim.ir.trace import Span


def test_spans_are_shifted_joined_and_start_at_zero():
    rank0 = [Span("0F0", "F", 0, "compute", 10.0, 11.0, 0, 0),
             Span("0SEND_F0", "SEND_F", 0, "send", 11.0, 11.0, 0, 0, pair=0, peer=1),
             Span("0PREFETCH1", "PREFETCH", 0, "h2d", 11.0, 11.5, 0, 1)]
    rank1 = [Span("1RECV_F0", "RECV_F", 1, "recv", 8.5, 8.5, 1, 0, pair=0, peer=0),  # clock 3 s behind rank 0
             Span("1F0", "F", 1, "compute", 8.5, 9.0, 1, 0)]
    trace = csp_trace([rank0, rank1], [0.0, 3.0], ["cpu", "cpu"], {"num_subnets": 1})
    assert [(s.op, s.start, s.end) for s in trace.spans] == [
        ("0F0", 0.0, 1.0), ("0SEND_F0", 1.0, 1.5), ("0PREFETCH1", 1.0, 1.5), ("1RECV_F0", 1.0, 1.5),
        ("1F0", 1.5, 2.0)]
    assert trace.meta == {"num_subnets": 1, "source": "executor", "schedule": "csp"}
