"""The schedule IR (DESIGN §3), the spine shared by the simulator and the executor: ops, per-rank programs and the
serialisable plan (``plan``), traces of timed ops (``trace``, level L2), PyTorch's schedule CSV view
(``schedule_csv``) and the weight-version rules of weight stashing (``weight_versions``).
"""
