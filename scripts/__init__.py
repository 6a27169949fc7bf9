"""Entry points, tools and benchmarks (run from the repository root)."""
