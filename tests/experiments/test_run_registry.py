"""experiments.run: no name is an error line, --out is checked before an experiment runs, and an experiment's files
are all or none."""

from dataclasses import replace

import pytest

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
