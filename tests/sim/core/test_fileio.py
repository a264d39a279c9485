"""sim.core.fileio: bounded input reads, output paths checked before any work, write errors as one SpecError."""

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.core.errors import OutputError, SpecError
from sim.core.fileio import (
    INPUT_LIMITS,
    check_output_file,
    json_with_record_lines,
    prepare_output_dir,
    read_text,
    write_bytes_atomic,
    write_json_atomic,
)

ROOT = Path(__file__).resolve().parents[3]

# --- inputs ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", sorted(INPUT_LIMITS))
def test_an_input_at_the_limit_is_read_and_one_byte_more_is_refused_with_the_limit_and_why(tmp_path, what):
    limit, why = INPUT_LIMITS[what]
    path = tmp_path / "input"
    path.write_bytes(b"a" * limit)
    assert len(read_text(path, what)) == limit
    path.write_bytes(b"a" * (limit + 1))
    with pytest.raises(SpecError) as info:
        read_text(path, what)
    shown = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit // 2**10} KiB"
    assert str(info.value) == f"{what} {path} is {limit + 1} bytes; the limit is {limit} bytes ({shown}): {why}"


def test_an_endless_input_is_refused_after_reading_one_byte_over_the_limit():
    # /dev/zero has size 0 and never ends: without a bounded read this would fill the memory.
    limit = INPUT_LIMITS["topology file"][0]
    with pytest.raises(SpecError, match=f"topology file /dev/zero is over {limit} bytes"):
        read_text("/dev/zero", "topology file")


def test_non_utf8_input_names_the_file_and_byte(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(SpecError, match=r"plan .*plan.json is not UTF-8 text \(byte 0xff at offset 7\)"):
        read_text(path, "plan")


# --- output paths ---------------------------------------------------------------------------------------------------


@pytest.fixture()
def here(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding a regular file ``f``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    return tmp_path


BAD_DIRS = [
    ("", "--out is empty ('')"),
    ("  ", "--out is empty ('  ')"),
    ("f", "--out 'f' exists and is not a directory"),
    ("f/sub", "--out 'f/sub': '{here}/f' is not a directory"),
    ("f/sub/deeper", "--out 'f/sub/deeper': '{here}/f' is not a directory"),
    ("/dev/null", "--out '/dev/null' exists and is not a directory"),
    ("a" * 300, "is 300 bytes; a file name may have at most 255"),
    ("ok/" + "b" * 256 + "/c", "is 256 bytes; a file name may have at most 255"),
    ("/proc/pipedejavu-out", "--out '/proc/pipedejavu-out': cannot"),  # procfs takes no new file, not even root's
    ("nul\0byte", "contains a NUL byte"),
]


@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("path,message", BAD_DIRS)
def test_a_bad_output_directory_is_one_spec_error_naming_flag_and_path_and_nothing_is_made(here, path, message,
                                                                                          create):
    with pytest.raises(SpecError) as info:
        prepare_output_dir(path, "--out", create=create)
    assert message.format(here=here) in str(info.value)
    assert sorted(os.listdir(here)) == ["f"]


def test_a_good_output_directory_is_made_with_its_parents_and_only_probed_without_create(here):
    assert prepare_output_dir("a/b", "--out", create=False) == type(here)("a/b")
    assert sorted(os.listdir(here)) == ["f"]  # checked, nothing left behind
    prepare_output_dir("a/b", "--out")
    assert (here / "a" / "b").is_dir() and list((here / "a" / "b").iterdir()) == []  # the probe file is gone
    prepare_output_dir("a/b", "--out")  # an existing directory is fine (a run may be written again)
    name = "c" * 255  # the longest name Linux allows is allowed
    prepare_output_dir(name, "--out")
    assert (here / name).is_dir()


BAD_FILES = [
    ("", "--calibrate-out is empty"),
    (".", "--calibrate-out '.' is a directory; name the file to write"),
    ("f/x.json", "--calibrate-out 'f/x.json': '{here}/f' is not a directory"),
    ("/dev/null", "--calibrate-out '/dev/null' exists and is not a regular file"),
    ("d" * 256 + ".json", "a file name may have at most 255"),
    ("/proc/x.json", "--calibrate-out '/proc/x.json': cannot write in '/proc'"),
]


@pytest.mark.parametrize("path,message", BAD_FILES)
def test_a_bad_output_file_is_one_spec_error_and_nothing_is_made(here, path, message):
    with pytest.raises(SpecError) as info:
        check_output_file(path, "--calibrate-out")
    assert message.format(here=here) in str(info.value)
    assert sorted(os.listdir(here)) == ["f"]


def test_a_good_output_file_is_checked_without_making_anything(here):
    check_output_file("new/dir/p.json", "--calibrate-out")
    check_output_file("f", "--calibrate-out")  # an existing regular file may be replaced
    check_output_file("e" * 255, "--calibrate-out")
    assert sorted(os.listdir(here)) == ["f"]


def test_a_name_of_255_bytes_is_written_through_a_shorter_temporary_name(here):
    write_json_atomic({"a": 1}, here / ("e" * 255))
    assert (here / ("e" * 255)).read_text() == '{\n "a": 1\n}\n'
    assert sorted(os.listdir(here)) == ["e" * 255, "f"]


# --- writes ---------------------------------------------------------------------------------------------------------


def test_a_write_that_fails_is_an_output_error_naming_the_file_not_its_temporary(here):
    with pytest.raises(OutputError) as info:
        write_bytes_atomic(here / "missing" / "x.json", b"{}")
    assert (info.value.filename, info.value.errno) == (f"{here}/missing/x.json", errno.ENOENT)
    assert info.value.strerror == os.strerror(errno.ENOENT)


def _write_over_the_size_limit(path: str) -> None:  # pragma: no cover - runs in a child process
    # RLIMIT_FSIZE makes write() fail with EFBIG past 1000 bytes, as a full disk fails with ENOSPC; Python ignores
    # SIGXFSZ, so the error reaches the writer.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    try:
        write_bytes_atomic(path, b"x" * 5000)
    except OutputError as exc:
        print(f"{exc.filename}: {exc.strerror}")


def test_a_write_refused_by_the_file_system_leaves_neither_the_file_nor_its_temporary(here):
    code = ("from tests.sim.core.test_fileio import _write_over_the_size_limit; "
            f"_write_over_the_size_limit({str(here / 'big.json')!r})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout == f"{here}/big.json: {os.strerror(errno.EFBIG)}\n", result.stderr
    assert sorted(os.listdir(here)) == ["f"]


# --- JSON with a record a line ----------------------------------------------------------------------------------------

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


@given(head=st.dictionaries(st.text(max_size=6), _VALUES, max_size=5),
       records=st.lists(st.dictionaries(st.text(max_size=6), _VALUES, max_size=4), max_size=6))
def test_a_record_a_line_parses_to_what_the_canonical_encoding_does(head, records):
    """The oracle is ``json`` itself: the same value as the indented canonical text, one line per record, and with no
    records exactly the canonical text."""
    data = {**head, "records": records}
    text = json_with_record_lines(data, "records")
    assert json.loads(text) == json.loads(json.dumps(data, sort_keys=True, indent=1))
    lines = {line.rstrip(",") for line in text.splitlines()}
    for record in records:  # each record is one line of the file, compact with sorted keys
        assert "  " + json.dumps(record, sort_keys=True) in lines
    empty = {**head, "records": []}
    assert json_with_record_lines(empty, "records") == json.dumps(empty, sort_keys=True, indent=1) + "\n"
