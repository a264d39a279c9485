"""From what the user typed to a validated L1 plan: partitioning layers into stages (``partition``), the whole
build (``build``), lowering L0 to L1 (``lower``) and validation (``validate``).
"""
