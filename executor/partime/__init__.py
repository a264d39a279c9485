"""PARTIME's online learning from a stream on real ranks: the interpreter's three differences
(``partime_interpreter``), the seeded synthetic video it learns from (``video``) and the single-process rule every
stage's weights must equal bitwise (``partime_reference``).
"""
