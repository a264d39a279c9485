"""How a run's failures are ordered and reported (``executor.failures``): the failure that caused the others comes
first, every failure keeps its status, a rank killed by a signal says which, and the report is one line on stderr with
everyone's story in the log. The end-to-end runs that produce these records are in ``test_lifecycle.py``."""

import pytest

from executor.failures import Failure, describe_exit, order_failures, report_failures


def _record(rank, time_s, message, status=1):
    return {"rank": rank, "op": None, "message": message, "status": status, "time": time_s, "traceback": "tb\n"}


ECHO = "rank 0 failed at op 0F2: RuntimeError: Connection closed by peer"


@pytest.mark.parametrize("exit_codes, records, first", [
    # A rank killed by a signal left no record; the survivor's record is its echo, however early it is stamped.
    ({0: 1, 1: -9}, [_record(0, 5.0, ECHO)], "rank 1 was killed by signal 9 (SIGKILL)"),
    ({1: -9}, [], "rank 1 was killed by signal 9 (SIGKILL)"),
    ({0: -15, 1: -11}, [], "rank 1 was killed by signal 11 (SIGSEGV)"),
    ({2: 3}, [], "rank 2 exited with status 3 without reporting why"),
    # Records: the earliest is the cause, whichever rank it is and in whatever order they were read.
    ({0: 1, 1: 1}, [_record(0, 7.5, ECHO), _record(1, 7.25, "rank 1 failed at op 1B1: KeyError: 'w'")],
     "rank 1 failed at op 1B1: KeyError: 'w'"),
    # A rank the launcher stopped with SIGTERM did not fail; a recorded failure comes before it.
    ({0: -15, 1: 1}, [_record(1, 3.0, "rank 1 failed: OSError")], "rank 1 failed: OSError"),
    # ... unless nothing else is known: then somebody else terminated it, and that is what happened.
    ({0: -15}, [], "rank 0 was killed by signal 15 (SIGTERM)"),
])
def test_the_first_failure_is_the_one_that_caused_the_others(exit_codes, records, first):
    ordered = order_failures(exit_codes, records)
    assert ordered[0].message == first
    assert sorted(f.rank for f in ordered) == sorted(set(exit_codes) | {r["rank"] for r in records})


def test_failures_are_ordered_in_full_and_keep_their_status():
    records = [_record(1, 2.0, "rank 1: bad", status=2), _record(2, 1.0, "rank 2 failed: X")]
    ordered = order_failures({0: -15, 1: 2, 2: 1, 3: -6}, records)
    assert ordered == [Failure(3, "rank 3 was killed by signal 6 (SIGABRT)", -6),
                       Failure(2, "rank 2 failed: X", 1, 1.0, "tb\n"),
                       Failure(1, "rank 1: bad", 2, 2.0, "tb\n"),
                       Failure(0, "rank 0 was killed by signal 15 (SIGTERM)", -15)]


@pytest.mark.parametrize("code, text", [(-9, "rank 4 was killed by signal 9 (SIGKILL)"),
                                        (-200, "rank 4 was killed by signal 200"),
                                        (1, "rank 4 exited with status 1 without reporting why")])
def test_describe_exit(code, text):
    assert describe_exit(4, code) == text


def test_the_report_is_one_line_and_the_log_holds_everyone(tmp_path, capsys):
    log = tmp_path / "new" / "errors.log"
    failures = order_failures({0: 1, 1: -9}, [_record(0, 5.0, ECHO)])
    assert report_failures(failures, {0: 1, 1: -9}, log) == 1
    assert capsys.readouterr().err == "error: rank 1 was killed by signal 9 (SIGKILL)\n"
    assert log.read_text() == ("rank 1 was killed by signal 9 (SIGKILL) (it left no report)\n"
                               f"rank 0 at 5.000000: {ECHO}\ntb\n\n"
                               "exit codes: rank 0: status 1, rank 1: signal 9\n")
    # A rank that rejected its input keeps the CLI's status 2; an unwritable log leaves the line as the report.
    bad_input = [Failure(0, "rank 0: plan x has 2 ranks but the launcher started 3", 2, 1.0)]
    assert report_failures(bad_input, {0: 2}, tmp_path / "new" / "errors.log" / "not-a-dir" / "x") == 2
    assert capsys.readouterr().err == "error: rank 0: plan x has 2 ranks but the launcher started 3\n"
