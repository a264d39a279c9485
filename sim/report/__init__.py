"""What a run writes: metrics (``metrics``), Chrome trace (``chrome_trace``), Gantt chart (``gantt``, matplotlib
imported lazily) and the files together (``outputs``). Imports only the IR and file I/O.
"""
