"""The benchmarks: ``python -m scripts.bench WORKLOAD [options]`` (see ``__main__.py``)."""
