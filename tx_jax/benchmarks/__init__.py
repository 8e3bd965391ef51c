"""Benchmarks behind `python -m experiments.benchmark`: one module per section.

`run(out_dir, only, options)` writes out_dir/benchmark.json (a top-level key per section)
and one PNG per section; see tx_jax/benchmarks/runner.py.
"""
