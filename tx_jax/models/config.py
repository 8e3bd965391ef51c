"""ModelConfig: the frozen hyperparameters every model family is built from.

One dataclass serves the three families because they share nearly every field
(ARCHITECTURE.md says why); each family reads the fields it uses. It is built
from `config.model` (an ml_collections ConfigDict whose fields are exactly
these) and validated before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import lora as lora_lib
from tx_jax.layers import ops
from tx_jax.layers.attention import BACKENDS
from tx_jax.layers.attention.ring import LOAD_BALANCE as CONTEXT_LOAD_BALANCE
from tx_jax.layers.attention.ring import VARIANTS as CONTEXT_PARALLEL
from tx_jax.layers.block import REMAT_POLICIES, LayerSpec
from tx_jax.layers.mlp import ACTIVATIONS
from tx_jax.layers.norms import NORMS, NormSpec

FAMILIES = ("decoder", "encoder", "encdec")
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "alibi", "none")
HEADS = ("none", "mlm", "classification")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
INITS = ("normal", "xavier_uniform")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyperparameters; see configs/common.py for each field's meaning."""

  family: str
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  num_decoder_layers: int = 0
  mlp_activation: str = "gelu"
  gated_mlp: bool = False
  norm: str = "layernorm"
  norm_eps: float = 1e-5
  norm_bias: bool = True
  pre_norm: bool = True
  embed_norm: bool = False
  positions: str = "learned"
  max_len: int = 512
  rope_theta: float = 10000.0
  relative_buckets: int = 32
  relative_max_distance: int = 128
  embed_scale: bool = False
  tie_embeddings: bool = True
  tied_output_rescale: bool = False
  attention_bias: bool = True
  mlp_bias: bool = True
  scale_attention: bool = True
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  mlp_inner_dropout_rate: float = 0.0
  type_vocab_size: int = 0
  pooler: bool = False
  head: str = "none"
  num_classes: int = 2
  init: str = "normal"
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_backend: str = "dense"
  blockwise_block_q: int = 512
  blockwise_block_k: int = 512
  packed_inputs: bool = True
  kernels: str = "plain"
  context_parallel: str = "ring"
  context_load_balance: str = "data"
  fused_qkv: bool = False
  scan_layers: bool = False
  remat_policy: str = "none"
  lora: lora_lib.LoraSpec = lora_lib.LoraSpec()

  @classmethod
  def from_config(cls, model_cfg: Any) -> "ModelConfig":
    """Builds and validates from `config.model`; unknown or missing fields are errors."""
    values = dict(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"config.model has unknown fields {unknown}; accepted: {sorted(known)}")
    lora = values.get("lora")
    if lora is not None and not isinstance(lora, lora_lib.LoraSpec):
      values["lora"] = lora_lib.from_dict(dict(lora))
    config = cls(**values)
    config.validate()
    return config

  def validate(self) -> None:
    """Raises ValueError naming the field, its value and what is accepted."""
    choices = {
        "family": FAMILIES,
        "positions": POSITIONS,
        "head": HEADS,
        "norm": NORMS,
        "mlp_activation": tuple(ACTIVATIONS),
        "dtype": tuple(DTYPES),
        "param_dtype": tuple(DTYPES),
        "attention_backend": tuple(BACKENDS),
        "kernels": ops.names(),
        "context_parallel": CONTEXT_PARALLEL,
        "context_load_balance": CONTEXT_LOAD_BALANCE,
        "remat_policy": tuple(REMAT_POLICIES),
        "init": INITS,
    }
    for name, accepted in choices.items():
      value = getattr(self, name)
      if value not in accepted:
        raise ValueError(f"config.model.{name}={value!r} is not one of {list(accepted)}")
    positive = [
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "max_len",
        "blockwise_block_q",
        "blockwise_block_k",
    ]
    if self.family == "encdec":
      positive.append("num_decoder_layers")
    for name in positive:
      if getattr(self, name) <= 0:
        raise ValueError(f"config.model.{name}={getattr(self, name)} must be > 0")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"config.model.num_heads={self.num_heads} must be a multiple of "
          f"config.model.num_kv_heads={self.num_kv_heads}"
      )
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"config.model.head_dim={self.head_dim} must be even for RoPE")
    if self.positions == "sinusoidal" and self.d_model % 2:
      raise ValueError(
          f"config.model.d_model={self.d_model} must be even for sinusoidal " "positions"
      )
    for name in ("dropout_rate", "attention_dropout_rate", "mlp_inner_dropout_rate"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"config.model.{name}={getattr(self, name)} must be in [0, 1)")
    if self.head == "classification" and self.num_classes < 1:
      raise ValueError(f"config.model.num_classes={self.num_classes} must be >= 1")
    lora_lib.validate(self.lora)
    if self.head != "none" and self.family != "encoder":
      raise ValueError(
          f"config.model.head={self.head!r} needs family 'encoder', " f"got {self.family!r}"
      )

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    return DTYPES[self.param_dtype]

  def kernel_init(self) -> nn.initializers.Initializer:
    if self.init == "xavier_uniform":
      return nn.initializers.xavier_uniform()
    return nn.initializers.normal(self.init_std)

  def norm_spec(self) -> NormSpec:
    """The norm of every layer and of the final / embedding / head norms."""
    return NormSpec(
        kind=self.norm,
        eps=self.norm_eps,
        use_bias=self.norm_bias,
        dtype=self.compute_dtype,
        param_dtype=self.storage_dtype,
        kernels=self.kernels,
    )

  def layer_spec(self, *, cross_attention: bool = False) -> LayerSpec:
    """The per-layer hyperparameters of this model's stacks."""
    return LayerSpec(
        num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        mlp_dim=self.mlp_dim,
        mlp_activation=self.mlp_activation,
        gated_mlp=self.gated_mlp,
        norm=self.norm_spec(),
        pre_norm=self.pre_norm,
        attention_bias=self.attention_bias,
        mlp_bias=self.mlp_bias,
        attention_scale=None if self.scale_attention else 1.0,
        rope_theta=self.rope_theta if self.positions == "rope" else None,
        dropout_rate=self.dropout_rate,
        attention_dropout_rate=self.attention_dropout_rate,
        mlp_inner_dropout_rate=self.mlp_inner_dropout_rate,
        attention_backend=self.attention_backend,
        blockwise_blocks=(self.blockwise_block_q, self.blockwise_block_k),
        fused_qkv=self.fused_qkv,
        kernels=self.kernels,
        context_parallel=self.context_parallel,
        context_reorder=self.context_load_balance == "attention",
        lora=self.lora if self.lora.enabled else None,
        cross_attention=cross_attention,
        kernel_init=self.kernel_init(),
        dtype=self.compute_dtype,
        param_dtype=self.storage_dtype,
    )
