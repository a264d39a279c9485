"""NASPipe's causal synchronous parallel (CSP) training of subnets: the pure decision rule shared with the executor
(``rules``), context switching under a parameter budget (``memory``), the problem and result types (``problem``),
the SimPy run (``simulate``), csp plans and the problems they pose (``csp_plan``), the ``csp`` block of
``metrics.json`` and the decision log (``csp_metrics``) and the baselines on the same subnets (``baselines``).
"""
