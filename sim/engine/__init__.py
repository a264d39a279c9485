"""The SimPy engine that replays an L1 plan on a topology with the cost oracle's durations (``simpy_engine``).
"""
