"""The attention backends by name, and what each cannot do.

Every backend is (q_BTNH, k_BSKH, v_BSKH, spec, *, scale, dropout_rate, dropout_rng,
deterministic, kernels) -> out_BTNH, equal to `dense` within float32 tolerance. It receives
the `AttentionSpec` (what may attend to what) and materialises only what it needs: `dense`
the whole [T, S] mask and bias, `blockwise` one block at a time, `pallas` and `splash`
segment ids only, `cudnn` sequence lengths (and a bias tensor, if the model has a bias).
Adding a backend means one module and one entry here.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import jax.numpy as jnp

from tx_jax.layers.attention.blockwise import DEFAULT_BLOCK, blockwise_attention
from tx_jax.layers.attention.cudnn import CUDNN_DTYPES, cudnn
from tx_jax.layers.attention.dense import dense

Array = jnp.ndarray


def _pallas(q_BTNH, k_BSKH, v_BSKH, spec, *, scale, kernels=None, **dropout) -> Array:
  del kernels
  # Imported on use: the Pallas/Triton modules are only needed by this backend.
  from tx_jax.layers.attention.pallas import pallas_attention  # pylint: disable=g-import-not-at-top

  return pallas_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale, **dropout)


def _splash(q_BTNH, k_BSKH, v_BSKH, spec, **kwargs) -> Array:
  # Imported on use: the Pallas TPU (Mosaic) modules are only needed by this backend.
  from tx_jax.layers.attention.splash import splash_attention  # pylint: disable=g-import-not-at-top

  return splash_attention(q_BTNH, k_BSKH, v_BSKH, spec, **kwargs)


# What the backends cannot do, for tx_jax.validation to refuse a config before any work
# (each backend also raises on its own when called).
GPU_ONLY_BACKENDS = ("cudnn", "pallas")
TPU_ONLY_BACKENDS = ("splash",)
NO_DROPOUT_BACKENDS = ("blockwise", "cudnn", "pallas", "splash")
NO_BIAS_BACKENDS = ("pallas", "splash")  # no T5 relative bias, no ALiBi
# Backends that take padding as lengths, so need unpacked rows (model.packed_inputs=False).
UNPACKED_ONLY_BACKENDS = ("cudnn",)

# The JAX modules holding a backend's kernel: jax 0.12.1 removed the Pallas GPU (Triton)
# attention that `pallas` wraps, while tx_jax supports jax up to 0.12.x.
KERNEL_MODULES = {
    "pallas": "jax.experimental.pallas.ops.gpu.attention",
    "splash": "jax.experimental.pallas.ops.tpu.splash_attention",
}


def missing_kernel(name: str) -> str | None:
  """The kernel module backend `name` needs if this JAX lacks it, else None."""
  module = KERNEL_MODULES.get(name)
  try:
    found = module is None or importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    found = False
  return None if found else module


BACKENDS: dict[str, Callable[..., Array]] = {
    "dense": dense,
    "blockwise": blockwise_attention,
    "cudnn": cudnn,
    "pallas": _pallas,
    "splash": _splash,
}


def get_backend(
    name: str, *, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK
) -> Callable[..., Array]:
  """Looks up an attention backend by name, with an error listing the accepted ones.

  `block_q` / `block_k` are `blockwise`'s query and key block sizes (model.blockwise_block_*).
  """
  if name not in BACKENDS:
    raise ValueError(f"model.attention_backend={name!r} is not one of {sorted(BACKENDS)}")
  if name == "blockwise":
    return functools.partial(blockwise_attention, block_q=block_q, block_k=block_k)
  return BACKENDS[name]
