"""pipedejavu simulator: layer graphs, hardware, the schedule IR, schedules, the SimPy engine and its outputs."""
