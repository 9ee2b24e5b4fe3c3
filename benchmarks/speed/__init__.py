"""Speed benchmarks, one module each: python -m benchmarks.speed.NAME --help."""
