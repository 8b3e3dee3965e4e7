"""Small, self-contained models and data used by the examples, tests and benchmarks."""
