"""From what the user typed to a validated L1 plan: partitioning layers into stages (``partition``), the whole
build (``build``), lowering L0 to L1 (``lower``), the tensor- and data-parallel collectives written into the L1
programs (``lower_collectives``) and validation (``validate``).
"""
