"""Plan search, the fastest plan that fits a model on a cluster: the space (:mod:`.space`), costing a candidate by the
one prediction path (:mod:`.evaluate`), evaluating many in a process pool under a time budget (:mod:`.driver`), the
search and its strategies (:mod:`.search`), its outputs (:mod:`.search_outputs`) and the command (:mod:`.cli`,
``python -m sim.search``).
"""
