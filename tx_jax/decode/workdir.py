"""Load a model to decode from: a trainer workdir or a HuggingFace model directory.

Reading the workdir (config, params only, tokenizer, special ids) is `tx_jax.workdir`'s;
this adds the decoding module (layers unrolled). Decoding itself is `tx_jax.decode.batches`.
"""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections

from tx_jax import workdir as wd
from tx_jax.decode.generate import decoding_module


def load(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[ml_collections.ConfigDict, Any, Any, int | None]:
  """(config, module, params, step) ready for `tx_jax.decode` (layers unrolled)."""
  config, params, step = wd.load(workdir, step)
  module, params = decoding_module(config.model, params)
  return config, module, params, step
