"""Scripts that reproduce published results (GPipe, PipeDream, NASPipe, PARTIME) and ours; one module per figure.

Each experiment is registered in ``experiments.run``; nothing outside ``experiments`` imports this package.
"""
