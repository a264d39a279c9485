"""File I/O for every command: bounded input reads, checked output paths, atomic and all-or-none output writes.

Inputs: plans, profiles, schedule CSVs and topology YAML are read through :func:`read_text`, which refuses a file
over its kind's size limit (:data:`INPUT_LIMITS`) before reading it, and a binary or mis-encoded one, with a
:class:`SpecError` naming the file.

Outputs: every output path is checked before the work that fills it, by :func:`prepare_output_dir` (a directory such as
``--out``) or :func:`check_output_file` (one file such as ``--calibrate-out``), which refuse with a :class:`SpecError`
naming the flag and the path: an empty path, an existing non-directory (or non-regular file), a parent that is a file,
a name longer than the file system allows, or a place where no file can be created (a read-only or full file system,
``/proc``). Writability is probed by creating a real file: permission bits say nothing for root.

Every output file is written through :func:`write_bytes_atomic` (a temporary file in the same directory, then a
rename), so no reader and no crash ever sees a partial file, and a failed write is an
:class:`~sim.core.errors.OutputError` naming the file (not its temporary). A set of files is all or none
(:mod:`sim.core.output_set`): each file is written atomically, and if the command fails afterwards
(:func:`sim.core.errors.run_cli`) what it wrote is removed and what it replaced is put back.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sim.core.errors import OutputError, SpecError
from sim.core.output_set import active_set, backup_name, claim_innermost_set

__all__ = ["INPUT_LIMITS", "read_text", "prepare_output_dir", "check_output_file", "write_bytes_atomic",
           "write_text_chunks_atomic", "write_text_atomic", "write_json_atomic"]

_MIB = 2**20

#: The most bytes an input file of each kind may hold, and why; checked before the file is read, so an oversized (or
#: endless, e.g. ``/dev/zero``) input costs nothing. Sizes come from the files this project writes: ``sim.run``'s
#: ``plan.json`` takes about 60 bytes per op, its ``schedule.csv`` about 6, a profile about 250 bytes per layer.
INPUT_LIMITS: dict[str, tuple[int, str]] = {
    "plan": (64 * _MIB, "about a million ops at the ~60 bytes per op sim.run writes; more would take gigabytes to "
             "load"),
    "schedule file": (8 * _MIB, "about a million ops at ~6 bytes per CSV cell"),
    "profile": (16 * _MIB, "tens of thousands of layers at ~250 bytes each"),
    "candidates file": (4 * _MIB, "a search's TP/DP/PP/microbatch settings at ~20 bytes a row: 200,000 rows, "
                        "more than any search costs"),
    "model config": (1 * _MIB, "a HuggingFace config.json is a few KiB of hyper-parameters; a weights file given "
                     "by mistake is gigabytes"),
    "routing trace": (8 * _MIB, "per-expert token counts: a few hundred layers of a few hundred experts at ~8 "
                      "bytes a count"),
    "topology file": (256 * 2**10, "a topology lists groups of servers ('repeat:' covers identical ones) and YAML "
                      "parsing takes seconds per MiB"),
}
_DEFAULT_LIMIT = (64 * _MIB, "no input of this project is larger")


def _size_text(nbytes: int) -> str:
    return f"{nbytes // _MIB} MiB" if nbytes % _MIB == 0 else f"{nbytes // 2**10} KiB"


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of an input file of at most ``INPUT_LIMITS[what]`` bytes.

    Args:
        path: the file.
        what: what the file is, for the message and the limit (``"plan"``, ``"profile"``, ``"schedule file"``,
            ``"topology file"``; another name gets 64 MiB).

    Raises:
        SpecError: the file is over the limit (the message says the size, the limit and why), or not UTF-8 text (the
            message names the first bad byte); it names ``what`` and the file.
        OSError: the file cannot be read (the CLIs report it as ``cannot read ...``).
    """
    limit, why = INPUT_LIMITS.get(what, _DEFAULT_LIMIT)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        # st_size is 0 for pipes and /proc files, so the read itself is bounded too: one byte over proves too much.
        data = handle.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        shown = f"{size} bytes" if size > limit else f"over {limit} bytes"
        raise SpecError(f"{what} {os.fspath(path)} is {shown}; the limit is {limit} bytes ({_size_text(limit)}): "
                        f"{why}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{what} {os.fspath(path)} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start})") from None


def _temp_name(target: Path) -> Path:
    """The temporary sibling a write of ``target`` goes through (its name is cut so that it fits any file system's
    255-byte name limit whatever ``target`` is called)."""
    return target.with_name(f".{target.name[:64]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _check_path_text(flag: str, path: str | os.PathLike) -> Path:
    text = os.fspath(path)
    if not str(text).strip():
        raise SpecError(f"{flag} is empty ({text!r}); name the path to write")
    if "\0" in str(text):
        raise SpecError(f"{flag} {text!r} contains a NUL byte")
    return Path(text).absolute()


def _name_too_long(flag: str, path: str | os.PathLike, target: Path, name_max: int) -> SpecError:
    longest = max(target.parts, key=lambda part: len(os.fsencode(part)))
    length = len(os.fsencode(longest))
    if length > name_max:
        return SpecError(f"{flag} {os.fspath(path)!r}: the name {longest[:40]!r}... is {length} bytes; a file name may "
                         f"have at most {name_max}")
    return SpecError(f"{flag} {os.fspath(path)!r}: the path is {len(os.fsencode(str(target)))} bytes, too long for "
                     f"this system")


def _existing_ancestor(flag: str, path: str | os.PathLike, target: Path) -> tuple[Path, list[Path]]:
    """The nearest existing ancestor of ``target`` (itself if it exists), which must be a directory unless it is
    ``target``, and the missing paths below it, outermost first; every missing name must fit the file system."""
    missing, node = [], target
    while True:
        try:
            os.stat(node)
            break
        except (FileNotFoundError, NotADirectoryError):
            missing.append(node)  # a NotADirectoryError is reported below, at the file that is in the way
            node = node.parent
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise _name_too_long(flag, path, target, 255) from None
            raise SpecError(f"{flag} {os.fspath(path)!r}: cannot look at {str(node)!r} "
                            f"({exc.strerror or exc})") from None
    if missing and not node.is_dir():
        raise SpecError(f"{flag} {os.fspath(path)!r}: {str(node)!r} is not a directory")
    try:
        name_max = os.pathconf(node, "PC_NAME_MAX") if node.is_dir() else 255
    except (OSError, ValueError):
        name_max = 255  # Linux's NAME_MAX, for a file system that does not say
    if any(len(os.fsencode(part.name)) > name_max for part in missing):
        raise _name_too_long(flag, path, target, name_max)
    return node, list(reversed(missing))


def _probe(flag: str, path: str | os.PathLike, directory: Path) -> None:
    """Create, write and remove a real file in ``directory``: the only test that holds for root, on read-only mounts
    and in ``/proc``; a full file system refuses the byte."""
    probe = _temp_name(directory / "pipedejavu-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise SpecError(f"{flag} {os.fspath(path)!r}: cannot write in {str(directory)!r} "
                        f"({exc.strerror or exc})") from None


def prepare_output_dir(path: str | os.PathLike, flag: str, *, create: bool = True) -> Path:
    """Check an output directory such as ``--out`` before anything is computed for it, and (with ``create``) make it.

    The checks: ``path`` is not empty (``''`` would mean the current directory); an existing ``path`` is a directory;
    its nearest existing ancestor is a directory; every missing name fits the file system's limit (255 bytes on
    Linux); and a file can really be created there (probed with one, which is removed). With ``create`` the missing
    directories are made and the probe is made inside ``path``, and the innermost open output set
    (:mod:`sim.core.output_set`; ``run_cli`` opens one around every command) records from now on: the files written
    and the directories made, so a failed command removes them again. Without ``create`` nothing is left behind and
    nothing is recorded (the executor checks before launch and writes at the end).

    Args:
        path: the directory.
        flag: the option that named it, for the message (``"--out"``).
        create: make the directory (default) or only check that it could be made.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        SpecError: naming ``flag``, ``path`` and what is wrong with it.
    """
    target = _check_path_text(flag, path)
    ancestor, missing = _existing_ancestor(flag, path, target)
    if not missing and not target.is_dir():
        raise SpecError(f"{flag} {os.fspath(path)!r} exists and is not a directory")
    if not create:
        _probe(flag, path, ancestor)
        return Path(path)
    outputs = claim_innermost_set()
    for directory in missing:
        try:
            directory.mkdir()
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to remove
        except OSError as exc:
            raise SpecError(f"{flag} {os.fspath(path)!r}: cannot create {str(directory)!r} "
                            f"({exc.strerror or exc})") from None
        if outputs is not None:
            outputs.created.append(directory)
    _probe(flag, path, target)
    return Path(path)


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Check a single output file such as ``--calibrate-out`` before anything is computed for it; creates nothing.

    The checks: ``path`` is not empty; it is not a directory; an existing ``path`` is a regular file (an atomic write
    replaces the name, so ``/dev/null`` would be replaced, not written to); its nearest existing ancestor is a
    directory; every missing name fits the file system's limit; a file can be created there (probed, then removed).
    Missing parent directories are made by the writer.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        SpecError: naming ``flag``, ``path`` and what is wrong with it.
    """
    target = _check_path_text(flag, path)
    ancestor, missing = _existing_ancestor(flag, path, target)
    if not missing:
        if target.is_dir():
            raise SpecError(f"{flag} {os.fspath(path)!r} is a directory; name the file to write, e.g. "
                            f"{Path(path) / 'profile.json'}")
        if not stat.S_ISREG(target.stat().st_mode):
            raise SpecError(f"{flag} {os.fspath(path)!r} exists and is not a regular file")
        ancestor = target.parent
    _probe(flag, path, ancestor)
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes | memoryview | Iterable[bytes]) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one.

    The bytes go to a temporary file in the same directory (same filesystem, so the rename is atomic), are flushed
    to disk, and the temporary file is then renamed over ``path``. On any error the temporary file is removed. Inside
    an open output set (:mod:`sim.core.output_set`) the file is recorded, and a file it replaces is kept (hard link)
    until the set completes, so a failed command can put it back.

    Args:
        path: the destination file; its directory must exist.
        data: the complete file content, or an iterable of chunks written in order (so that a large file, such as
            a plan of millions of ops, never has to be in memory whole).

    Raises:
        OutputError: the file cannot be written (full or read-only file system, missing directory, ...); its
            ``filename`` is ``path``, not the temporary file.
    """
    target = Path(path)
    tmp = _temp_name(target)
    outputs = active_set()
    backup, moved = None, False
    try:
        # os.open with mode 0o666 lets the umask decide the final permissions, like a plain open() would.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                if isinstance(data, bytes | bytearray | memoryview):
                    handle.write(data)
                else:
                    for chunk in data:
                        handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            if outputs is not None and (target.is_symlink() or target.is_file()):
                backup = backup_name(target)
                try:
                    os.link(target, backup, follow_symlinks=False)
                except OSError:  # a file system without hard links: move it aside (a moment with no file there)
                    os.rename(target, backup)
                    moved = True
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if backup is not None:
                if moved:
                    os.replace(backup, target)
                else:
                    backup.unlink(missing_ok=True)
            raise
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)
        raise OutputError(exc.errno, reason, os.fspath(path)) from None
    if outputs is not None:
        outputs.written.append((target, backup))


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_text_chunks_atomic(chunks: Iterable[str], path: str | os.PathLike) -> None:
    """Write UTF-8 text given as consecutive chunks to ``path`` atomically, one chunk in memory at a time."""
    write_bytes_atomic(path, (chunk.encode("utf-8") for chunk in chunks))


def write_json_atomic(data: Any, path: str | os.PathLike) -> None:
    """Write canonical JSON (sorted keys, one-space indent, trailing newline) to ``path`` atomically."""
    write_text_atomic(json.dumps(data, sort_keys=True, indent=1) + "\n", path)


#: ``json.dumps(x, sort_keys=True)`` as one encoder kept for every call: ``json.dumps`` with a keyword builds a new
#: encoder each time, a third of a record's time when a search writes tens of thousands.
_SORTED_COMPACT = json.JSONEncoder(sort_keys=True)


def json_with_record_lines(data: Mapping[str, Any], records_key: str) -> str:
    """``data`` as canonical JSON (sorted keys, one-space indent, trailing newline), except that the list under
    ``records_key`` holds one record per line, each compact with sorted keys.

    For files with tens of thousands of records (a search's candidates): an indented encoding makes ``json`` use its
    pure-Python encoder, about ten times slower than the C one that a compact record gets, and a record a line is as
    easy to read and to diff. The text parses to the same value as :func:`write_json_atomic` writes.
    """
    fields = []
    for key in sorted(data):
        if key == records_key:
            rows = ",\n".join("  " + _SORTED_COMPACT.encode(record) for record in data[key])
            value = f"[\n{rows}\n ]" if rows else "[]"
        else:  # JSON strings escape newlines, so every newline here is the layout's: indent it one level
            value = json.dumps(data[key], sort_keys=True, indent=1).replace("\n", "\n ")
        fields.append(f" {json.dumps(key)}: {value}")
    return "{\n" + ",\n".join(fields) + "\n}\n" if fields else "{}\n"
