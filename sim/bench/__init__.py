"""The benchmarks (``python -m sim.bench``, the command in :mod:`sim.bench.cli`) and the code only they and the
experiments run: the longest-path evaluator that replays the engine's semantics on a plan's cost views
(:mod:`~sim.bench.critical_path`) and its cache per plan structure (:mod:`~sim.bench.fast`), the evaluators' rate
(:mod:`~sim.bench.rate`), the screen at cluster scale (:mod:`~sim.bench.scale`), joint partition and placement
checked against brute force (:mod:`~sim.bench.joint_check`). The search's strategies use none of it: they cost
plans by the one prediction path, ``sim.predict``."""
