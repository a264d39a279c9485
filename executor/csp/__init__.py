"""NASPipe's CSP on real ranks: the per-rank online loop (``runner``), host-device parameter copies under a budget
(``offload``) and the measured trace (``trace``).
"""
