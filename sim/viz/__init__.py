"""Outputs of a trace: Chrome trace-event JSON and a Gantt chart (matplotlib imported lazily)."""
