"""Hardware: the device and link catalog with the source of every number (``catalog``, data in
``profiles/hardware``), the topology grammar and YAML files (``grammar``) and what they describe (``description``),
what a real server of each device is (``node_shapes``), the description's servers (``servers``) and their link graph
(``link_graph``), and the resulting networkx topology with paths, links and transfer times (``topology``).
"""
