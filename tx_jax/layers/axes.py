"""Every logical axis name, once. `tx_jax.sharding` maps them onto mesh axes through the rules
in configs/sharding_rules.py.

Parameters and activations carry separate names so that the two can be sharded independently
(MaxText's convention). Activation names follow the shape letters of `layers/__init__.py`, so
`constrain(x_BTD, "BTD")` reads as the tensor's shape.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
QKV = "qkv"  # which projection, in a stacked [embed, qkv, heads | kv_heads, head_dim] kernel
LAYERS = "layers"  # the leading axis of scanned (stacked) layer parameters
RELPOS_BUCKETS = "relpos_buckets"
TYPE_VOCAB = "type_vocab"
POSITION = "position"
LORA_RANK = "lora_rank"  # a LoRA adapter's rank: small, so replicated
PARAM_AXES = (
    VOCAB,
    EMBED,
    MLP,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    QKV,
    LAYERS,
    RELPOS_BUCKETS,
    TYPE_VOCAB,
    POSITION,
    LORA_RANK,
)

# Activation axes, by shape letter.
ACTIVATION_AXES = {
    "B": "act_batch",
    "T": "act_len",
    "S": "act_kv_len",
    "D": "act_embed",
    "N": "act_heads",
    "K": "act_kv_heads",
    "H": "act_head_dim",
    "F": "act_mlp",
    "V": "act_vocab",
}
ACT_BATCH = ACTIVATION_AXES["B"]
ACT_LEN = ACTIVATION_AXES["T"]


def activation_axes(shape: str) -> tuple[str, ...]:
  """The logical names of an activation whose shape letters are `shape`, e.g. "BTD"."""
  unknown = [letter for letter in shape if letter not in ACTIVATION_AXES]
  if unknown:
    raise ValueError(
        f"activation shape {shape!r}: unknown letters {unknown}; accepted: "
        f"{''.join(ACTIVATION_AXES)}"
    )
  return tuple(ACTIVATION_AXES[letter] for letter in shape)


def constrain(x: jnp.ndarray, shape: str) -> jnp.ndarray:
  """`x` constrained to the layout the rules give its shape letters (a no-op without rules)."""
  if x.ndim != len(shape):
    raise ValueError(f"constrain: shape {shape!r} names {len(shape)} dims, the array has {x.ndim}")
  return nn.with_logical_constraint(x, activation_axes(shape))
