"""Basics every layer of the simulator uses: the error type and CLI error format (``errors``), atomic file
writing and strict reading (``fileio``, ``output_set``), the ``name:key=value`` spec grammar (``spec``), the shared
argument parser and byte sizes (``cli``), a child process's life tied to its parent's (``lifetime``), output files
made on two cores (``parallel_outputs``) and the garbage collector paused around large acyclic work
(``collector``). Imports nothing else from ``sim``.
"""
