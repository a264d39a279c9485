"""NASPipe's CSP on real ranks: the per-rank online loop (``runner``), host-device parameter copies under a budget
(``offload``), the measured trace (``trace``), a csp plan run on ranks or as its sequential reference
(``csp_plan_run``) and rank 0's outputs (``csp_outputs``).
"""
