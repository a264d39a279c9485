"""NASPipe's causal synchronous parallel (CSP) training of subnets: the pure decision rule shared with the executor
(``rules``), context switching under a parameter budget (``memory``), the problem and result types (``problem``),
the SimPy run (``simulate``), building a problem from user choices (``build``) and the baselines on the same
subnets (``baselines``).
"""
