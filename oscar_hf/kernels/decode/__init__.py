"""The decode kernel: split-K attention of one (or a few) query tokens over a PackedKV: its stages
(``stage0.py`` rotates the query, ``stage1.py`` attends the parts, ``stage2.py`` merges them), their launch
(``triton.py``) and its heuristics (``launch.py``); twin ``reference.py``."""
