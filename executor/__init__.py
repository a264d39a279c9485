"""pipedejavu executor: runs a plan written by ``sim.run`` on real devices with torch.distributed (DESIGN §7).

``python -m executor.run --plan plan.json --out DIR`` checks the plan, launches one worker per rank (``run.py``,
``worker.py``), builds each rank's stages from the plan's model spec (``modules.py``), interprets its L1 program
(``interpreter.py``), puts every rank's op timings on one clock (``clock.py``, ``measured.py``) and has rank 0 write
the measured trace, metrics, ``compare.json`` and optionally a calibrated profile (``finish.py``, ``compare.py``).
``reference.py`` is the single-process training that a synchronous pipeline must reproduce.
"""
