"""The decode kernel: split-K attention of one (or a few) query tokens over a PackedKV (``triton.py``, launch
heuristics ``launch.py``; twin ``reference.py``)."""
