"""Evaluation harness: every KV method as a named preset, tasks that run the quantized cache in the loop."""

from .methods import METHODS, Method, check_methods, make_cache, stored_bits

__all__ = ["METHODS", "Method", "check_methods", "make_cache", "stored_bits"]
