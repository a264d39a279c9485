"""Scripts that reproduce published results (GPipe, PipeDream, NASPipe, PARTIME) and ours; one module per figure.

Each experiment is registered in ``experiments.run``; nothing outside ``experiments`` imports this package.

Every experiment module ``experiments.NAME`` has the same shape, so that its result is data a test or another
experiment can read, and printing belongs to the command alone:

- ``Result``: a frozen dataclass, everything the experiment found (the rows its tables, files and figures are made
  of), with units in its docstring.
- ``parser() -> CliParser``: its command line as the user types it (``--out`` with the registry's default where it
  writes files); ``python -m experiments.run NAME --help`` prints it.
- ``run(*, quick=False, ...) -> Result``: the computation. Its keywords are the parser's destinations but ``out``
  (``--time-budget`` is ``time_budget``), so the command calls ``run(**vars(args))``; a bad value is a
  :class:`sim.core.errors.SpecError` whose message names the flag, as the command prints it. It may take more
  keywords, with defaults, that no flag sets (a test's smaller grid). It prints nothing: one that reports progress
  takes ``progress``, a callable given one line, which the command writes to stderr. One whose computation leaves
  files of its own (real runs' directories, the topology files a search reads) takes ``out``, the ``--out``
  directory, and writes them there as it goes.
- ``report(result) -> str``: what the command prints (its tables, its verdicts beside the published numbers), without
  a final newline.
- ``write(result, out) -> list[Path]``: its files, written into the existing directory ``out``, in the order it
  names them; only an experiment with ``--out`` has it. The command then prints ``wrote OUT/{a, b}``, or the line the
  module's ``wrote(out, files) -> str`` says where it has one.

:func:`experiments.harness.execute` is those steps in order; ``experiments.run`` and ``experiments.results`` both call
it. Tests call ``run`` and assert on the ``Result`` (and on ``write``'s files), never on printed text. The one
exception to the shape is ``experiments.results``, which runs all the others: it keeps a ``main`` of its own (it needs
the registry, and exits 1 when an experiment failed).
"""
