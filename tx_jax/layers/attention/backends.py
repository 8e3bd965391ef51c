"""The attention backends by name, and what each cannot do.

Every backend is (q_BTNH, k_BSKH, v_BSKH, spec, *, scale, dropout_rate, dropout_rng,
deterministic, kernels) -> out_BTNH, equal to `dense` within float32 tolerance. It receives
the `AttentionSpec` (what may attend to what) and materialises only what it needs: `dense`
the whole [T, S] mask and bias, `blockwise` one block at a time, `pallas` segment ids only,
`cudnn` a mask and bias tensor. Adding a backend means one module and one entry here.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from tx_jax.layers.attention.blockwise import blockwise_attention
from tx_jax.layers.attention.cudnn import CUDNN_DTYPES, cudnn
from tx_jax.layers.attention.dense import dense

Array = jnp.ndarray


def _pallas(q_BTNH, k_BSKH, v_BSKH, spec, *, scale, kernels=None, **dropout) -> Array:
  del kernels
  # Imported on use: the Pallas/Triton modules are only needed by this backend.
  from tx_jax.layers.attention.pallas import pallas_attention  # pylint: disable=g-import-not-at-top

  return pallas_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale, **dropout)


# What the backends cannot do, for tx_jax.validation to refuse a config before any work
# (each backend also raises on its own when called).
GPU_ONLY_BACKENDS = ("cudnn", "pallas")
NO_DROPOUT_BACKENDS = ("blockwise", "cudnn", "pallas")

BACKENDS: dict[str, Callable[..., Array]] = {
    "dense": dense,
    "blockwise": blockwise_attention,
    "cudnn": cudnn,
    "pallas": _pallas,
}


def get_backend(name: str) -> Callable[..., Array]:
  """Looks up an attention backend by name, with an error listing the accepted ones."""
  if name not in BACKENDS:
    raise ValueError(f"model.attention_backend={name!r} is not one of {sorted(BACKENDS)}")
  return BACKENDS[name]
