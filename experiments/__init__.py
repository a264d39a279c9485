"""Scripts that reproduce published results (GPipe, PipeDream, NASPipe, PARTIME) and ours; one module per figure.

Empty until the first experiment lands (issue #3 adds ``sim_vs_real``); nothing imports this package.
"""
