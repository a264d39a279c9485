"""Built-in hardware data (hardware/*.yaml), measured layer profiles (measured/*.json) and the profiler that writes
them (``python -m profiles.measure``); see README.md.

This package file imports nothing: ``sim.hw.catalog`` reads the YAML through ``importlib.resources.files("profiles")``,
and sim must never load torch (DESIGN §2). The torch-based modules (``measure``, ``layer_timing``, ``p2p``,
``host_copy``) are imported only by their users.
"""
