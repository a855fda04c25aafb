"""Absorbed multi-head latent attention for decode steps over a latent cache (``reference.py``)."""
