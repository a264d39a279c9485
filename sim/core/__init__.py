"""Basics every layer of the simulator uses: the error type and CLI error format (``errors``), atomic file
writing and strict reading (``fileio``), the ``name:key=value`` spec grammar (``spec``) and units (``units``).
Imports nothing else from ``sim``.
"""
