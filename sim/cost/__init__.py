"""The one cost oracle (DESIGN §5): durations in s and sizes in bytes of layers, stages and messages on a topology
(``oracle``), its per-plan view for the engines (``model``), and the measured profiles that replace the roofline
where they apply (``profile``, ``p2p_fit``).
"""
