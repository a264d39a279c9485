"""Hardware: the device and link catalog with the source of every number (``catalog``, data in
``profiles/hardware``), node shapes and their wiring (``nodes``), the topology grammar and YAML files (``grammar``)
and the resulting networkx topology with paths, links and transfer times (``topology``).
"""
