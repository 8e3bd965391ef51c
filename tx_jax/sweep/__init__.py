"""Sweeps: `def sweep(add)` beside a config, run locally or on SLURM, summarised.

Config files import the grid helpers from here: `from tx_jax.sweep import product, zipped`.
"""

from tx_jax.sweep.grid import SweepError, cross, product, zipped

__all__ = ["SweepError", "cross", "product", "zipped"]
