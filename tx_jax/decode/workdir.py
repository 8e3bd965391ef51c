"""Load a model to decode from (a trainer workdir or an HF directory) and decode inputs.

Reading the workdir (config, params only, tokenizer, special ids) is `tx_jax.workdir`'s.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np

from tx_jax import workdir as wd
from tx_jax.decode import models as dm
from tx_jax.decode.models import decoding_module
from tx_jax.decode.prompts import make_prompt, strip_generated


def load(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[ml_collections.ConfigDict, Any, Any, int | None]:
  """(config, module, params, step) ready for `tx_jax.decode.models` (layers unrolled)."""
  config, params, step = wd.load(workdir, step)
  module, params = decoding_module(config.model, params)
  return config, module, params, step


def decode_inputs(
    module: Any,
    params: Any,
    inputs: list[list[int]],
    strategy: Any,
    *,
    eos_id: int | None,
    decoder_start_id: int,
    rng: jax.Array | None,
    batch_size: int,
) -> list[list[int]]:
  """Generated ids (EOS stripped) per input: prompts for a decoder, sources for an encdec."""
  config = module.config
  outputs: list[list[int]] = []
  for begin in range(0, len(inputs), batch_size):
    chunk = inputs[begin : begin + batch_size]
    # Filler rows keep one compiled shape per batch; widths round up to 16 for the same reason.
    rows = chunk + [[chunk[0][-1] if chunk[0] else 1]] * (batch_size - len(chunk))
    width = -(-max(len(r) for r in rows) // 16) * 16
    if rng is not None:
      rng, key = jax.random.split(rng)
    else:
      key = None
    if config.family == "decoder":
      prompt = make_prompt(
          rows,
          max_new_tokens=strategy.max_new_tokens,
          max_len=config.max_len,
          pad_to=min(width, config.max_len - strategy.max_new_tokens + 1),
      )
      result = dm.generate(module, params, prompt, strategy, eos_id=eos_id, rng=key)
    else:
      for i, row in enumerate(chunk):
        if not row:
          raise ValueError(f"input {begin + i} is empty; every source needs a token")
      ids = np.zeros((batch_size, min(width, config.max_len)), np.int32)
      for i, row in enumerate(rows):
        if len(row) > config.max_len:
          raise ValueError(
              f"input {begin + i} has {len(row)} tokens, longer than "
              f"model.max_len={config.max_len}"
          )
        ids[i, : len(row)] = row
      result = dm.translate(
          module,
          params,
          ids,
          (ids != 0).astype(np.int32),
          strategy,
          eos_id=eos_id,
          decoder_start_id=decoder_start_id,
          rng=key,
      )
    best = dm.best(result)
    tokens, lengths = jax.device_get((best.tokens, best.lengths))
    outputs += [strip_generated(tokens[i], int(lengths[i]), eos_id) for i in range(len(chunk))]
  return outputs
