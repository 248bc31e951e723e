"""Mixture-of-Experts language models: the pure library (no Prefect, no DVC)."""
