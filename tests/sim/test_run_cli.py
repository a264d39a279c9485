"""``python -m sim.run``: outputs, determinism, schedule files and the one-line errors."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.models import build_model
from sim.report.chrome_trace import read_chrome_trace
from sim.run import main

SMALL = ["--topology", "4xV100", "--model", "gpt:layers=6,hidden=256,seq=128,vocab=1000", "--microbatches", "6"]


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr()


def test_writes_every_output_and_a_summary(tmp_path, capsys):
    code, out = _run(capsys, *SMALL, "--out", str(tmp_path))
    assert code == 0
    for name in ("plan.json", "schedule.csv", "metrics.json", "trace.json", "gantt.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("iteration_time_s", "throughput_samples_per_s", "idle_fraction", "bubble_fraction",
                "exposed_comm_fraction"):
        assert key in metrics
    assert [d["rank"] for d in metrics["devices"]] == [0, 1, 2, 3]
    assert all({"device", "busy_s", "idle_fraction", "bubble_fraction", "exposed_comm_fraction", "peak_memory_bytes"}
               <= set(d) for d in metrics["devices"])
    trace = read_chrome_trace(tmp_path / "trace.json")
    assert metrics["iteration_time_s"] == pytest.approx(trace.makespan)
    plan = Plan.loads((tmp_path / "plan.json").read_text())
    assert plan.level == "L1" and plan.num_ranks == 4
    assert "iteration time" in out.out and "device time       compute" in out.out and "DGX-1" in out.out


def test_summary_and_metrics_say_where_the_costs_come_from(tmp_path, capsys):
    args = ["--topology", "2xcpu", "--model", "gpt:layers=2,hidden=64,seq=16,vocab=50", "-m", "2"]
    code, out = _run(capsys, *args, "--out", str(tmp_path / "roofline"))
    assert code == 0 and "costs roofline" in out.out
    graph = build_model(Plan.loads((tmp_path / "roofline" / "plan.json").read_text()).model)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "format": "pipedejavu-profile", "format_version": 1, "model": graph.spec,
        "device": "cpu", "microbatch_size": 1, "p2p": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9},
        "layers": [{"name": layer.name, "fwd_s": 0.001, "bwd_s": 0.002} for layer in graph.layers]}))
    code, out = _run(capsys, *args, "--profile", str(profile), "--out", str(tmp_path / "measured"))
    assert code == 0
    line = (f"measured profile {profile} (cpu, 1 sample(s) per microbatch) on ranks 0-1, roofline elsewhere; "
            "measured p2p")
    assert f"costs {line}" in out.out
    assert json.loads((tmp_path / "measured" / "metrics.json").read_text())["plan"]["costs"] == line


def test_costs_line_names_exactly_the_plans_ranks_on_the_profiles_device(tmp_path, capsys):
    """2xV100+2xA100+2xV100 with a V100 profile: ranks 2-3 are A100s on the roofline, so the line says 0-1 and 4-5;
    a schedule file using only ranks 0-3 of the six devices names 0-1 (ranks 4-5 are not in the plan)."""
    topology = "2xV100+2xA100+2xV100"
    args = ["--topology", topology, "--model", "gpt:layers=4,hidden=64,seq=16,vocab=50", "--no-gantt"]
    graph = build_model("gpt:layers=4,hidden=64,seq=16,vocab=50")
    v100 = Topology.parse(topology).devices[0].name
    profile = tmp_path / "v100.json"
    profile.write_text(json.dumps({
        "format": "pipedejavu-profile", "format_version": 1, "model": graph.spec, "device": v100,
        "microbatch_size": 1, "p2p": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9},
        "layers": [{"name": layer.name, "fwd_s": 0.001, "bwd_s": 0.002} for layer in graph.layers]}))
    code, out = _run(capsys, *args, "-m", "6", "--profile", str(profile), "--out", str(tmp_path / "six"))
    line = (f"measured profile {profile} ({v100}, 1 sample(s) per microbatch) on ranks 0-1, 4-5, GPU kernel model "
            "(profiles/hardware/kernel_model.yaml) elsewhere; measured p2p")
    assert code == 0 and f"costs {line}\n" in out.out
    assert json.loads((tmp_path / "six" / "metrics.json").read_text())["plan"]["costs"] == line
    csv = tmp_path / "four.csv"
    csv.write_text("0F0,0B0\n1F0,1B0\n2F0,2B0\n3F0,3B0\n")
    code, out = _run(capsys, *args, "--schedule-file", str(csv), "--partition", "1,1,2,2", "--profile", str(profile),
                     "--out", str(tmp_path / "four"))
    assert code == 0 and f"({v100}, 1 sample(s) per microbatch) on ranks 0-1, GPU kernel model" in out.out


def test_costs_line_names_the_gpu_kernel_model_for_a_gpt_on_gpus(tmp_path, capsys):
    gpt = ["--model", "gpt:layers=2,hidden=64,seq=16,vocab=50", "-m", "2", "--no-gantt"]
    code, out = _run(capsys, "--topology", "2xA100", *gpt, "--out", str(tmp_path / "gpu"))
    assert code == 0 and "costs GPU kernel model (profiles/hardware/kernel_model.yaml)" in out.out
    code, out = _run(capsys, "--topology", "1xA100+1xcpu", *gpt, "--out", str(tmp_path / "mixed"))
    assert code == 0 and "costs GPU kernel model on rank 0, roofline on the others" in out.out
    code, out = _run(capsys, "--topology", "2xA100", "--model", "cnn", "-m", "2", "--no-gantt",
                     "--out", str(tmp_path / "cnn"))
    assert code == 0 and "costs roofline (hardware catalog)" in out.out


def test_binary_input_files_are_one_error_line_naming_the_file(tmp_path, capsys):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    yaml_file = tmp_path / "binary.yaml"
    yaml_file.write_bytes(binary.read_bytes())
    base = ["--model", "uniform:layers=2", "--out", str(tmp_path / "out")]
    for args, what in (
        (["--topology", "2xideal", "--profile", str(binary)], "profile"),
        (["--topology", "2xideal", "--schedule-file", str(binary)], "schedule file"),
        (["--topology", str(yaml_file)], "topology file"),
    ):
        with pytest.raises(SystemExit) as info:
            main([*args, *base])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {what} ") and "binary" in err and "not UTF-8 text (byte 0x89 at offset 0)" in err
        assert not (tmp_path / "out").exists()


def test_same_inputs_give_byte_identical_plan_and_trace(tmp_path, capsys):
    for name in ("a", "b"):
        assert _run(capsys, *SMALL, "--schedule", "gpipe", "--no-gantt", "--out", str(tmp_path / name))[0] == 0
    for name in ("plan.json", "trace.json", "metrics.json", "schedule.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_schedule_csv_reads_back_to_the_same_plan(tmp_path, capsys):
    assert _run(capsys, *SMALL, "--no-gantt", "--out", str(tmp_path / "gen"))[0] == 0
    csv = tmp_path / "gen" / "schedule.csv"
    assert csv.read_text().splitlines()[0].startswith("0F0,0F1,0F2,0F3,0B0,")
    assert _run(capsys, *SMALL, "--schedule-file", str(csv), "--no-gantt", "--out", str(tmp_path / "file"))[0] == 0
    generated = Plan.loads((tmp_path / "gen" / "plan.json").read_text())
    loaded = Plan.loads((tmp_path / "file" / "plan.json").read_text())
    assert loaded.programs == generated.programs and loaded.placement == generated.placement
    a = json.loads((tmp_path / "gen" / "metrics.json").read_text())
    b = json.loads((tmp_path / "file" / "metrics.json").read_text())
    assert a["iteration_time_s"] == b["iteration_time_s"]


def test_schedule_defaults_to_1f1b_and_a_file_alone_names_it(tmp_path, capsys):
    assert _run(capsys, *SMALL, "--no-gantt", "--out", str(tmp_path / "default"))[0] == 0
    assert _run(capsys, *SMALL, "--schedule", "1f1b", "--no-gantt", "--out", str(tmp_path / "named"))[0] == 0
    default = Plan.loads((tmp_path / "default" / "plan.json").read_text())
    assert default.schedule == "1f1b"
    assert default.programs == Plan.loads((tmp_path / "named" / "plan.json").read_text()).programs
    csv = tmp_path / "default" / "schedule.csv"
    assert _run(capsys, *SMALL, "--schedule-file", str(csv), "--no-gantt", "--out", str(tmp_path / "file"))[0] == 0
    assert Plan.loads((tmp_path / "file" / "plan.json").read_text()).schedule == "file"


def test_lists(capsys):
    code, out = _run(capsys, "--model", "list", "--topology", "x")
    assert code == 0 and "gpt" in out.out and "uniform" in out.out
    code, out = _run(capsys, "--model", "x", "--topology", "list")
    assert code == 0 and "dgx-h100" in out.out and "ideal" in out.out


def _bad_files(tmp_path):
    csv = tmp_path / "bad.csv"
    csv.write_text("0F0,0B0\n1F0,zzz\n")
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("nodes: [::: not yaml\n")
    return csv, yaml_file


BAD = [
    (["--topology", "4xR300", "--model", "uniform"], "R300"),
    (["--topology", "0xV100", "--model", "uniform"], "0xV100"),
    (["--topology", "16xV1OO", "--model", "uniform"], "V1OO"),
    (["--topology", "2xV100", "--model", "gpt:layers=-1"], "-1"),
    (["--topology", "2xV100", "--model", "uniform:layers=0"], "layers"),
    (["--topology", "2xV100", "--model", "uniform", "--microbatches", "0"], "--microbatches"),
    (["--topology", "2xV100", "--model", "uniform", "--microbatches", "-3"], "-3"),
    (["--topology", "2xV100", "--model", "uniform", "--microbatch-size", "0"], "--microbatch-size"),
    (["--topology", "2xV100", "--model", "uniform", "--microbatches", "x"], "'x'"),
    (["--topology", "2xV100", "--model", "uniform", "--schedule", "zb9"], "zb9"),
    (["--topology", "8xideal", "--model", "uniform:layers=4"], "more stages (8"),
    (["--topology", "2xV100", "--model", "bert"], "bert"),
    (["--topology", "2xV100", "--model", "uniform", "--partition", "3,3"], "3,3"),
    (["--topology", "2xV100", "--model", "uniform", "--profile", "/nonexistent/p.json"], "/nonexistent/p.json"),
    (["--topology", "2xideal", "--model", "uniform", "--chunks", "2"], "--chunks 2 needs an interleaved"),
    (["--topology", "2xideal", "--model", "uniform", "--schedule", "zb1p", "--chunks", "3"], "--chunks 3"),
    (["--topology", "4xideal", "--model", "uniform", "--schedule", "interleaved", "--chunks", "2", "-m", "6"],
     "--microbatches 6 with 4 ranks"),
    (["--topology", "4xideal", "--model", "uniform", "--schedule", "interleaved"], "--chunks >= 2"),
    (["--topology", "2xideal", "--model", "uniform", "--chunks", "x"], "'x'"),
    # csp takes none of the fixed schedules' options: each is named, not silently dropped.
    (["--topology", "2xideal", "--space", "c0", "--schedule", "csp", "--recompute"], "--recompute"),
    (["--topology", "2xideal", "--space", "c0", "--schedule", "csp", "--chunks", "2"], "--chunks"),
    (["--topology", "2xideal", "--space", "c0", "--schedule", "csp", "--chunks", "1"], "--chunks"),
    (["--topology", "2xideal", "--space", "c0", "--schedule", "csp", "--vertical-sync"], "--vertical-sync"),
    (["--topology", "2xideal", "--space", "c0", "--schedule", "csp", "--schedule-file", "s.csv"], "--schedule-file"),
    # An explicit --schedule next to --schedule-file would be ignored: both are the schedule, so one must go.
    (["--topology", "2xideal", "--model", "uniform", "--schedule", "pipedream", "--schedule-file", "f.csv"],
     "--schedule pipedream and --schedule-file f.csv"),
    (["--topology", "2xideal", "--model", "uniform", "--schedule", "1f1b", "--schedule-file", "f.csv"],
     "--schedule 1f1b and --schedule-file f.csv"),
]


@pytest.mark.parametrize("args, needle", BAD)
def test_bad_input_is_one_error_line_and_status_2(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main([*args, "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "out" / "plan.json").exists()


def test_malformed_schedule_csv_and_yaml(tmp_path, capsys):
    csv, yaml_file = _bad_files(tmp_path)
    for args, needle in (
        (["--topology", "2xV100", "--model", "uniform", "--schedule-file", str(csv)], "row 2, column 2"),
        (["--topology", str(yaml_file), "--model", "uniform"], "bad.yaml"),
    ):
        with pytest.raises(SystemExit) as info:
            main([*args, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and needle in err, err


def test_deadlocking_schedule_file_is_rejected_before_running(tmp_path, capsys):
    csv = tmp_path / "deadlock.csv"
    csv.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(SystemExit) as info:
        main(["--topology", "2xideal", "--model", "uniform:layers=2", "--schedule-file", str(csv),
              "--partition", "1,1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: plan deadlocks") and ">>0B0<<" in err
    assert not (tmp_path / "out").exists()


def test_out_of_memory_leaves_no_outputs(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--topology", "2xV100", "--model", "uniform:layers=2,act_mb=12000", "--schedule", "gpipe",
              "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert info.value.code == 2 and captured.out == ""
    assert captured.err.startswith("error: out of memory: rank ") and captured.err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_out_of_memory_names_the_excess_and_flags_that_fit_and_they_do(tmp_path, capsys):
    """A 32-layer h4096 GPT at seq 8192 on 8 A100s with DP 8: the training state alone is 110 GB. The advice's first
    remedy, typed back as flags, must simulate without running out of memory (the engine is the oracle)."""
    argv = ["--topology", "8xA100", "--model", "gpt:layers=32,hidden=4096,seq=8192", "--schedule", "1f1b",
            "--global-batch", "64", "--dp", "8"]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "peaks at " in err and "GB over its 80.00 GB" in err and "training state alone is 110.23 GB" in err
    first = err.split("these would fit: ")[1].split(" (")[0].split()
    assert main([*argv, *first, "--out", str(tmp_path / "fixed"), "--no-gantt"]) == 0
    assert "peak memory" in capsys.readouterr().out


def test_no_traceback_from_the_real_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sim.run", "--topology", "16xV1OO", "--model", "uniform",
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")


@pytest.mark.parametrize("args, schedule, ranks_of_vstages", [
    (["--schedule", "interleaved", "--chunks", "2", "-m", "8"], "interleaved", [0, 1, 2, 3, 0, 1, 2, 3]),
    (["--schedule", "zb1p"], "zb1p", [0, 1, 2, 3]),
    (["--schedule", "zb1p", "--recompute"], "zb1p", [0, 1, 2, 3]),
    (["--schedule", "interleaved", "--chunks", "2", "-m", "8", "--recompute"], "interleaved", [0, 1, 2, 3, 0, 1, 2, 3]),
])
def test_new_schedules_and_recompute_from_the_command_line(tmp_path, capsys, args, schedule, ranks_of_vstages):
    code, out = _run(capsys, *SMALL, *args, "--no-gantt", "--out", str(tmp_path))
    assert code == 0
    plan = Plan.loads((tmp_path / "plan.json").read_text())
    assert plan.schedule == schedule and list(plan.placement.vstage_to_rank) == ranks_of_vstages
    recompute = "--recompute" in args
    assert plan.option("recompute", False) is recompute
    kinds = {op.kind.value for program in plan.programs for op in program}
    assert ("R" in kinds) is recompute and (("I" in kinds) and ("W" in kinds)) is (schedule == "zb1p")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["plan"]["recompute"] is recompute
    assert metrics["plan"]["vstage_to_rank"] == ranks_of_vstages
    assert (("activation recomputation" in out.out) is recompute
            and ("2 chunks per rank" in out.out) is (schedule == "interleaved"))


def test_a_decode_error_from_an_unnamed_read_is_still_one_error_line(capsys):
    from sim.core.errors import run_cli

    with pytest.raises(SystemExit) as info:
        run_cli(lambda: b"ok\xc3(".decode("utf-8"))
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: an input file is not UTF-8 text (byte 0xc3 at offset 2)\n"


# --- lists alone, output paths, a write that fails, Ctrl-C -----------------------------------------------------------


def test_each_list_works_alone_and_a_missing_topology_is_still_an_error(tmp_path, capsys):
    from sim.hw.catalog import list_links
    from sim.hw.topology import format_topology_list
    from sim.models import format_model_list

    code, out = _run(capsys, "--model", "list")
    assert code == 0 and out.out == format_model_list() + "\n"
    code, out = _run(capsys, "--topology", "list")
    assert code == 0 and out.out == format_topology_list() + "\n"
    assert all(f"\n  {link.name} " in out.out for link in list_links())  # what a YAML 'network:' may name
    code, out = _run(capsys, "--model", "list", "--topology", "list")
    assert code == 0 and out.out == format_model_list() + "\n\n" + format_topology_list() + "\n"
    with pytest.raises(SystemExit) as info:
        main(["--model", "uniform", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: --topology is required (e.g. 16xV100, a YAML file, or 'list')\n"


@pytest.mark.parametrize("out, message", [
    ("f", "--out 'f' exists and is not a directory"),
    ("f/sub", "--out 'f/sub': '{here}/f' is not a directory"),
    ("/dev/null", "--out '/dev/null' exists and is not a directory"),
    ("a" * 300, "is 300 bytes; a file name may have at most 255"),
    ("/proc/pipedejavu-out", "--out '/proc/pipedejavu-out': cannot"),
])
@pytest.mark.parametrize("schedule", [[], ["--schedule", "csp", "--space", "c0", "--subnets", "2"]])
def test_an_unusable_out_is_one_error_line_and_nothing_is_written(tmp_path, monkeypatch, capsys, out, message,
                                                                  schedule):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    model = [] if schedule else ["--model", "uniform:layers=4"]
    with pytest.raises(SystemExit) as info:
        main(["--topology", "2xideal", *model, *schedule, "--no-gantt", "--out", out])
    assert info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(here=tmp_path) in err, err
    assert captured.out == ""  # refused before anything is simulated or printed, not after the summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _sim_run_limited(args, max_file_bytes):
    """``python -m sim.run args`` in a child that may write no file over ``max_file_bytes`` (RLIMIT_FSIZE: a write
    past it fails with EFBIG, as one on a full disk fails with ENOSPC; Python ignores SIGXFSZ)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run([sys.executable, "-m", "sim.run", *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)


@pytest.mark.parametrize("earlier_run", [False, True])
def test_a_write_that_fails_midway_leaves_the_out_directory_as_it_was(tmp_path, earlier_run):
    out = tmp_path / "runs" / "a"
    args = [*SMALL, "--no-gantt", "--out", str(out)]
    if earlier_run:  # a complete earlier run in --out must come back whole, not mixed with the new one
        assert subprocess.run([sys.executable, "-m", "sim.run", *args, "--schedule", "gpipe"],
                              capture_output=True).returncode == 0
    before = _tree(tmp_path)
    # plan.json (~7 kB), schedule.csv and metrics.json fit in 20 kB; trace.json (~40 kB), written after them, does not.
    proc = _sim_run_limited(args, 20_000)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: cannot write '{out}/trace.json': {os.strerror(errno.EFBIG)}\n"
    assert _tree(tmp_path) == before  # no plan.json, schedule.csv or metrics.json of the failed run, no temporaries
    assert out.is_dir() is earlier_run  # the directories the failed run made are gone too


def test_ctrl_c_while_writing_is_one_line_status_130_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import sim.report.outputs

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim.report.outputs, "write_chrome_trace", interrupted)  # after plan, schedule and metrics
    status = None
    try:
        main([*SMALL, "--no-gantt", "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:  # not let through: pytest would take it for the user's and stop the whole session
        pytest.fail("KeyboardInterrupt came out of sim.run (a traceback for the user)")
    except SystemExit as exc:
        status = exc.code
    assert status == 130 and capsys.readouterr().err == "error: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def _wait_until_reading_a_pipe(pid: int, timeout_s: float = 30.0) -> None:
    """Poll until process ``pid`` sleeps in a pipe read (Linux's ``/proc/PID/wchan``); elsewhere wait half a second."""
    wchan = Path(f"/proc/{pid}/wchan")
    if not wchan.exists():
        time.sleep(0.5)
        return
    deadline = time.monotonic() + timeout_s
    while "pipe" not in wchan.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_sigint_is_one_line_and_status_130_from_the_real_entry_point(tmp_path):
    # The topology is a FIFO: sim.run blocks reading it, so the signal surely arrives while the command runs (a
    # signal before Python's handler is installed would kill the process instead; that is not what this tests).
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    # SIGINT gets its default action in the child whatever this process inherited: a test run started in the
    # background of a script ignores SIGINT, the child would inherit that, and CPython would then not install its
    # KeyboardInterrupt handler (the signal would be lost and the read would block on).
    proc = subprocess.Popen([sys.executable, "-m", "sim.run", "--topology", str(fifo), "--model", "uniform",
                             "--out", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while True:  # opening the writing end succeeds once sim.run has opened the reading end
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO and proc.poll() is None, proc.communicate()
                time.sleep(0.01)
        # Wait until sim.run sleeps in the read itself (the FIFO is open for writing but gets no bytes): a signal in
        # the microseconds between its open() returning and its read() starting would be handled before the read
        # blocks, and the read would then wait for bytes that never come (about 1 run in 6 when sent at once).
        _wait_until_reading_a_pipe(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        os.close(writer)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "error: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


def test_a_closed_stdout_is_one_error_line_and_keeps_nothing(tmp_path):
    """``sim.run ... | head`` whose reader has gone: the command cannot report what it did, so it stops with one
    line and status 141 (128 + SIGPIPE) and its files are rolled back like any unfinished command's."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command prints anything
    try:
        result = subprocess.run([sys.executable, "-m", "sim.run", "--topology", "2xideal", "--model",
                                 "uniform:layers=4", "--no-gantt", "--out", str(tmp_path / "out")],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr.startswith("error: standard output was closed") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


TINY = ["--model", "gpt:layers=4", "--topology", "2xcpu"]


@pytest.mark.parametrize(("args", "suggestion"), [
    (["--model", "gtp:layers=4", "--topology", "2xcpu"], "unknown model 'gtp' in spec 'gtp:layers=4'; did you mean "
                                                          "gpt?"),
    (["--model", "gpt:layrs=4", "--topology", "2xcpu"], "unknown key(s) layrs in spec 'gpt:layrs=4'; did you mean "
                                                         "layers?"),
    (["--model", "llama3.1-8bb", "--topology", "2xcpu"], "; did you mean llama3.1-8b,"),
    ([*TINY, "--partition", "balancd"], "got 'balancd'; did you mean balanced?"),
    ([*TINY, "--rank-order", "tp-pp-dpp"], "got 'tp-pp-dpp'; did you mean tp-pp-dp"),
    ([*TINY, "--schedule", "1fb1"], "invalid choice: '1fb1'; did you mean 1f1b"),
])
def test_a_misspelt_name_is_refused_with_the_closest_valid_ones(tmp_path, capsys, args, suggestion):
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and suggestion in err, err
    assert not (tmp_path / "out").exists()
