"""The write kernel: clip, center, quantize and pack K and V rows (``triton.py``; twin ``reference.py``)."""
