"""Benchmarks, each a script printing JSON and measured against a peer (README's "Layout").

Run one from the repository as `python -m benchmarks.bench_x` or from any folder as
`python /path/to/benchmarks/bench_x.py`; tests/test_benchmarks.py runs them all small."""
