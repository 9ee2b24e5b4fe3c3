"""Every architecture trained and measured at equal wall clock: python -m benchmarks.compare."""
