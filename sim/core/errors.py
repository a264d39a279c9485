"""The one exception type for bad user input, and how the CLIs report it.

Library code raises :class:`SpecError` (a ``ValueError``) with the offending value in the message, naming its own
arguments, not a command's flags: a library function may be called by a command, a test, an experiment or a plan file's
reader, and only a command knows which flag a value came from. The command-line entry points run their body through
:func:`run_cli`, which prints ``error: <message>`` with exit status 2, never a traceback (DESIGN §8), with each argument
the command took from a flag written as that flag (its ``flags``); Ctrl-C is ``error: interrupted`` with status 130 (128
+ SIGINT, the shell's convention). :func:`run_cli` also makes the command's output files all or none
(:mod:`sim.core.output_set`): if the body fails or is interrupted, what it wrote is removed before the error line is
printed.
"""

from __future__ import annotations

import atexit
import difflib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn, TypeVar

from sim.core.output_set import all_or_none

__all__ = ["SpecError", "OutputError", "fail", "run_cli", "did_you_mean", "exit_on_interrupt_while_starting",
           "exit_without_teardown", "INTERRUPTED_STATUS"]

T = TypeVar("T")

#: Exit status after Ctrl-C: 128 + SIGINT (2), what a shell reports for a process the signal ended.
INTERRUPTED_STATUS = 130

#: Exit status when standard output is closed under the command (``sim.run ... | head``): 128 + SIGPIPE, as a
#: shell reports a process killed by SIGPIPE.
PIPE_CLOSED_STATUS = 141


class SpecError(ValueError):
    """A user-supplied value (spec string, file, argument) is invalid; the message names the value.

    Where the message names arguments of the function that raised it, it writes each as ``{name}`` and passes the
    names after the message: ``SpecError(f"{{microbatch_size}} must be >= 1, got {b}", "microbatch_size")`` reads
    ``microbatch_size must be >= 1, got 0``, and :meth:`for_flags` writes it for a command that took the value from a
    flag (``--microbatch-size must be >= 1, got 0``).

    Attributes:
        template: the message with its arguments as ``{name}``.
        arguments: the names of the arguments it mentions.
    """

    def __init__(self, message: str, *arguments: str) -> None:
        self.template, self.arguments = message, arguments
        super().__init__(self.for_flags({}))

    def for_flags(self, flags: Mapping[str, str]) -> str:
        """The message with each argument that ``flags`` maps (argument name -> flag) written as its flag, the others
        as their names."""
        text = self.template
        for name in self.arguments:
            text = text.replace("{" + name + "}", flags.get(name, name))
        return text


class OutputError(OSError):
    """An output file could not be written (a full or read-only file system, a vanished directory): ``filename`` is
    the file, never the temporary it was written through, and ``strerror`` says why. An ``OSError``, so a caller that
    handles those still does; the CLIs print ``error: cannot write '<file>': <why>``."""


def did_you_mean(name: object, valid: Iterable[str], *, n: int = 3, cutoff: float = 0.5, prefix: str = "") -> str:
    """``"; did you mean a, b?"`` naming the valid names closest to ``name`` (case-insensitive, by
    :func:`difflib.get_close_matches`), or ``""`` when none is close: what an error about an unknown name adds after
    the name, so that every command suggests alike. A ``prefix`` every name shares (``--`` of a flag) is left out of
    the likeness, which it would otherwise inflate."""
    def bare(text: str) -> str:
        return text.strip().lower().removeprefix(prefix)

    by_bare = {bare(str(v)): str(v) for v in valid}
    close = difflib.get_close_matches(bare(str(name)), list(by_bare), n=n, cutoff=cutoff)
    return f"; did you mean {', '.join(by_bare[c] for c in close)}?" if close else ""


def fail(message: str, status: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``status`` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """SIGINT before :func:`run_cli`: the command's one line and its status, now (nothing has been written yet)."""
    try:
        sys.stderr.write("error: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED_STATUS)


def exit_on_interrupt_while_starting() -> None:
    """For a command's ``__main__``, before its heavy imports (torch, SimPy, networkx, matplotlib: one to two seconds):
    until :func:`run_cli` takes over, Ctrl-C prints ``error: interrupted`` and exits with 130 at once, instead of a
    ``KeyboardInterrupt`` traceback from inside an import. Only in the main thread (elsewhere it does nothing)."""
    try:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread
        pass


def exit_without_teardown(status: int) -> NoReturn:
    """For a command's ``__main__`` once its body has returned: end the process with ``status`` as a normal exit
    would (standard streams flushed, non-daemon threads joined, ``atexit`` handlers run: multiprocessing's and Ray's
    clean-ups among them), but without the interpreter's teardown, which frees every module's objects one by one.
    After a large search that teardown alone took 0.15-0.2 s on the 2-core machine (2026-12-07), a fifth of what a
    Ctrl-C may take; the operating system reclaims the memory at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach its reader
            pass
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own call at exit: the registered handlers, last registered first
    for stream in (sys.stdout, sys.stderr):  # what the handlers printed
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def run_cli(main: Callable[[], T], flags: Mapping[str, str] | None = None) -> T:
    """Run a CLI body, turning :class:`SpecError`, :class:`OutputError` (and unreadable or non-UTF-8 files) into one
    ``error:`` line and exit 2, ``KeyboardInterrupt`` into ``error: interrupted`` and exit 130, a closed stdout into one
    line and exit 141; the files the body wrote are kept only if it returns
    (:func:`sim.core.output_set.all_or_none`). ``flags`` maps the library arguments the command sets from its flags
    to those flags (``{"microbatch_size": "--microbatch-size"}``), so that an error speaks of what the user typed."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # started: Ctrl-C is KeyboardInterrupt again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with all_or_none(lazy=True):  # recording from the command's prepare_output_dir on
            result = main()
            sys.stdout.flush()  # a closed stdout fails here, inside the command, not at interpreter exit
            return result
    except KeyboardInterrupt:
        fail("interrupted", INTERRUPTED_STATUS)
    except BrokenPipeError:
        # The reader of stdout left (e.g. `| head`): the command stopped there, so its files were rolled back like
        # any unfinished command's. Point stdout at /dev/null so that the interpreter's final flush stays quiet.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
        except OSError:
            pass
        fail("standard output was closed before the command finished (a pipe's reader exited); nothing was kept",
             PIPE_CLOSED_STATUS)
    except SpecError as exc:
        fail(exc.for_flags(flags or {}))
    except OutputError as exc:
        fail(f"cannot write {exc.filename!r}: {exc.strerror}")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # Outputs are written through sim.core.fileio, whose errors are OutputErrors; an OSError here is an input.
        fail(f"cannot read {exc.filename!r}: {exc.strerror}")
    except UnicodeDecodeError as exc:
        # Input files are read through sim.core.fileio.read_text, which names the file; this is the backstop for a read
        # that is not, where the exception knows the bytes but not the file.
        fail(f"an input file is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})")
