"""Tests of the benchmarks (benchmarks/): their command lines run as python -m from the repository root."""
