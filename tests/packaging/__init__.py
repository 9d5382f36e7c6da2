"""Packaging: what runs with `pip install .[serve]` alone (no `kernels` extra, so no triton package)."""
