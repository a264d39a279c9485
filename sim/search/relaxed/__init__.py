"""The differentiable relaxation of a layout's per-stage choices (``--strategy relaxed``, and ``experiments.run
relaxed_search``'s comparison with the exact program and brute force): the descent and its rounding to a plan
(``relaxation``) and the smooth surrogate of the iteration time it descends, with its gradient (``surrogate``).
Every number either takes comes from the simulator's cost oracle.
"""
