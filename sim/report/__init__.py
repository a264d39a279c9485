"""What a run writes: metrics (``metrics``), Chrome trace (``chrome_trace``), Gantt chart (``gantt``, matplotlib
imported lazily; its geometry and size bounds in ``gantt_layout``) and the files together (``outputs``). Imports
only the IR and file I/O.
"""
