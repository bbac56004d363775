"""detdata benchmarks: run modules with ``python -m benchmarks.<name>``; results in ``results/``."""
