"""Benchmarks, run from the repository root: python -m benchmarks.claims, .compare or .speed.NAME."""
