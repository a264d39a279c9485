"""Faults over a long run: how often a job fails, what each failure costs, how often to checkpoint (DESIGN: the
simulator models one iteration; this package turns it into a run of many, with failures and recoveries)."""
