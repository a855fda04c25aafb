"""The dequantize kernel: a per-token history back to the model dtype (``triton.py``; twin ``reference.py``)."""
