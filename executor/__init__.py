"""pipedejavu executor: runs a plan written by ``sim.run`` on real devices with torch.distributed (DESIGN §7).

Not built yet: the interpreter of L1 programs, the stage modules and the launcher arrive with issue #3. Nothing in
this package is importable as a feature until then.
"""
