"""experiments.run, the command line: it prints an experiment's report and writes its files, lists them, refuses no
name, an unknown one or an unknown flag in one error line, checks --out before an experiment runs, and keeps an
experiment's files all or none. What each experiment finds is its own test's, on the data ``run`` returns."""

from dataclasses import replace

import pytest

from experiments import harness, zero_bubble
from experiments.run import EXPERIMENTS, Experiment, main
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic


def _status(capsys, argv):
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_no_name_is_one_error_line_on_stderr_and_status_2(capsys):
    status, out, err = _status(capsys, [])
    assert (status, out) == (2, "")
    assert err == (f"error: name an experiment ({', '.join(sorted(EXPERIMENTS))}) or 'list': "
                   "python -m experiments.run NAME\n")


def test_the_command_prints_the_report_and_the_files_it_wrote(tmp_path, capsys):
    # One cheap experiment through the command: what it prints is its report and the wrote line, and its files are
    # what write writes for the same result.
    status, out, err = _status(capsys, ["zero_bubble", "--quick", "--out", str(tmp_path / "cli")])
    assert (status, err) == (0, "")
    result = zero_bubble.run(quick=True)
    assert out == (f"{zero_bubble.report(result)}\n"
                   f"wrote {tmp_path / 'cli'}/{{zero_bubble.csv, zero_bubble.png}}\n")
    (tmp_path / "lib").mkdir()
    for written in zero_bubble.write(result, tmp_path / "lib"):
        assert (tmp_path / "cli" / written.name).read_bytes() == written.read_bytes()


def test_list_names_every_experiment_and_an_unknown_one_is_an_error_line(capsys):
    status, out, _ = _status(capsys, ["list"])
    assert status == 0 and [line.split()[0] for line in out.splitlines()] == list(EXPERIMENTS)
    status, out, err = _status(capsys, ["nope"])
    assert (status, out) == (2, "") and err.startswith("error: unknown experiment 'nope'") and err.count("\n") == 1


@pytest.mark.parametrize("name", sorted(n for n in EXPERIMENTS if n != "results"))
def test_every_experiment_has_the_package_s_shape_and_refuses_an_unknown_flag(tmp_path, capsys, name):
    module = harness.load(name)
    for function in ("parser", "run", "report"):
        assert callable(getattr(module, function)), function
    assert hasattr(module, "Result") and hasattr(module, "write") == (EXPERIMENTS[name].out is not None)
    out_flag = ["--out", str(tmp_path / "o")] if EXPERIMENTS[name].out is not None else []
    status, out, err = _status(capsys, [name, *out_flag, "--zzzz"])  # like no flag, so nothing is suggested
    assert (status, out) == (2, "") and err == "error: unrecognized arguments: --zzzz\n"
    assert not (tmp_path / "o").exists()


def test_help_is_usage_on_stdout_and_status_0(capsys):
    status, out, err = _status(capsys, ["--help"])
    assert (status, err) == (0, "") and out.startswith("usage: python -m experiments.run")


@pytest.fixture()
def fake(monkeypatch, tmp_path):
    """A registered experiment that records its argv, writes two files into --out, then maybe fails."""
    calls = []

    def run(argv):
        calls.append(argv)
        out = tmp_path / argv[argv.index("--out") + 1]
        write_text_atomic("table", out / "table.md")
        write_text_atomic("{}", out / "results.json")
        if "--fail" in argv:
            raise SpecError("the experiment failed after writing")
        return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(EXPERIMENTS, "fake", Experiment("fake", "a test double", run, out="runs/fake"))
    return calls


def test_the_registrys_default_out_is_made_and_passed(tmp_path, capsys, fake):
    assert _status(capsys, ["fake"])[0] == 0
    assert fake == [["--out", "runs/fake"]]
    assert sorted(p.name for p in (tmp_path / "runs" / "fake").iterdir()) == ["results.json", "table.md"]


def test_a_failed_experiment_leaves_none_of_its_files_nor_the_directories_made_for_them(tmp_path, capsys, fake):
    status, _, err = _status(capsys, ["fake", "--out", "a/b", "--fail"])
    assert (status, err) == (2, "error: the experiment failed after writing\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("out, message", [
    ("f", "--out 'f' exists and is not a directory"),
    ("f/sub", "--out 'f/sub': '{tmp}/f' is not a directory"),
    ("/dev/null", "--out '/dev/null' exists and is not a directory"),
    ("a" * 300, "a file name may have at most 255"),
    ("", "--out is empty"),
])
@pytest.mark.parametrize("name", ["fake", *sorted(name for name, e in EXPERIMENTS.items() if e.out is not None)])
def test_an_unusable_out_is_refused_before_the_experiment_runs(tmp_path, capsys, fake, monkeypatch, name, out,
                                                               message):
    # Every registered experiment that writes files, so a new one is covered without editing this test.
    for real in (name for name, e in EXPERIMENTS.items() if e.out is not None):  # they must not start
        monkeypatch.setitem(EXPERIMENTS, real, replace(EXPERIMENTS[real], main=lambda argv: pytest.fail("it ran")))
    (tmp_path / "f").write_text("a file")
    for flag in (["--out", out], [f"--out={out}"]):
        status, _, err = _status(capsys, [name, *flag])
        assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message.format(tmp=tmp_path) in err
    assert fake == [] and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
