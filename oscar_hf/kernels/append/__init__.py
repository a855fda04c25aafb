"""The append kernel: a decode step's token into a static layer's PackedKV, on the device (``triton.py``; twin
``reference.py``)."""
