"""The papers' claims with their controls: python -m benchmarks.claims --paper PAPER (one module per paper)."""
