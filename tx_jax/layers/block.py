"""One Transformer layer (self-attention, optional cross-attention, MLP) and a stack of them.

Everything here takes plain arguments through `LayerSpec`; model families
fill the spec from their config. The stack can unroll its layers or `nn.scan`
over them (one compiled layer, parameters stacked on a leading "layers" axis),
each optionally rematerialised.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.layers import axes, ops
from tx_jax.layers.attention import AttentionSpec, MultiHeadAttention
from tx_jax.layers.lora import LoraSpec
from tx_jax.layers.mlp import GatedMlp, Mlp
from tx_jax.layers.norms import NormSpec, make_norm, residual

Array = jnp.ndarray

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """Hyperparameters of one Transformer layer."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  mlp_activation: str = "relu"
  gated_mlp: bool = False
  norm: NormSpec = NormSpec()
  pre_norm: bool = True
  attention_bias: bool = False
  mlp_bias: bool = True
  attention_scale: float | None = None
  rope_theta: float | None = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  mlp_inner_dropout_rate: float = 0.0
  attention_backend: str = "dense"
  blockwise_blocks: tuple[int, int] = (512, 512)  # `blockwise` backend's (query, key) blocks
  fused_qkv: bool = False  # self-attention from stacked q, k, v kernels (MultiHeadAttention)
  kernels: str = ops.PLAIN  # the `layers.ops` kernel set of every projection and attention
  context_parallel: str = "ring"  # self-attention on a sequence-split mesh: "ring", "all_gather"
  context_reorder: bool = False  # zig-zag order made inside attention (else the batch's order)
  lora: LoraSpec | None = None  # low-rank adapters on the projections its targets name
  cross_attention: bool = False
  kernel_init: Any = nn.initializers.lecun_normal()
  output_init: Any = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32


class TransformerLayer(nn.Module):
  """x -> self-attention -> [cross-attention] -> MLP, each a pre- or post-norm residual."""

  spec: LayerSpec
  train: bool = False
  decode: bool = False

  @nn.compact
  def __call__(
      self,
      x_BTD: Array,
      encoded_BSD: Array | None,
      self_spec: AttentionSpec | None,
      cross_spec: AttentionSpec | None,
      positions_BT: Array | None,
  ) -> Array:
    s = self.spec
    drop = nn.Dropout(s.dropout_rate, deterministic=not self.train)

    def attention(name: str) -> MultiHeadAttention:
      return MultiHeadAttention(
          num_heads=s.num_heads,
          num_kv_heads=s.num_kv_heads,
          head_dim=s.head_dim,
          use_bias=s.attention_bias,
          dropout_rate=s.attention_dropout_rate,
          backend=s.attention_backend,
          blockwise_blocks=s.blockwise_blocks,
          scale=s.attention_scale,
          rope_theta=s.rope_theta if name == "self_attention" else None,
          fused_qkv=s.fused_qkv and name == "self_attention",
          kernel_init=s.kernel_init,
          output_init=s.output_init,
          dtype=s.dtype,
          param_dtype=s.param_dtype,
          kernels=s.kernels,
          context_parallel=s.context_parallel,
          context_reorder=s.context_reorder,
          lora=s.lora,
          name=name,
      )

    self_attention = attention("self_attention")
    x_BTD = residual(
        x_BTD,
        lambda h: self_attention(
            h,
            spec=self_spec,
            query_positions=positions_BT,
            key_positions=positions_BT,
            train=self.train,
            decode=self.decode,
        ),
        make_norm(s.norm, "self_attention_norm"),
        pre_norm=s.pre_norm,
        dropout=drop,
    )
    if s.cross_attention:
      cross_attention = attention("cross_attention")
      x_BTD = residual(
          x_BTD,
          lambda h: cross_attention(
              h, encoded_BSD, spec=cross_spec, is_cross=True, train=self.train, decode=self.decode
          ),
          make_norm(s.norm, "cross_attention_norm"),
          pre_norm=s.pre_norm,
          dropout=drop,
      )
    mlp_cls = GatedMlp if s.gated_mlp else Mlp
    mlp = mlp_cls(
        hidden=s.mlp_dim,
        activation=s.mlp_activation,
        use_bias=s.mlp_bias,
        inner_dropout_rate=s.mlp_inner_dropout_rate,
        kernel_init=s.kernel_init,
        output_init=s.output_init,
        dtype=s.dtype,
        param_dtype=s.param_dtype,
        kernels=s.kernels,
        lora=s.lora,
        name="mlp",
    )
    x_BTD = residual(
        x_BTD,
        lambda h: mlp(h, train=self.train),
        make_norm(s.norm, "mlp_norm"),
        pre_norm=s.pre_norm,
        dropout=drop,
    )
    return axes.constrain(x_BTD, "BTD")


class _ScannedLayer(nn.Module):
  """Adapter giving TransformerLayer the (carry, *broadcast) -> (carry, None) form of nn.scan."""

  spec: LayerSpec
  train: bool = False
  decode: bool = False
  remat_policy: str = "none"

  @nn.compact
  def __call__(self, x_BTD, encoded_BSD, self_spec, cross_spec, positions_BT):
    layer_cls = _maybe_remat(TransformerLayer, self.remat_policy)
    layer = layer_cls(self.spec, train=self.train, decode=self.decode, name="layer")
    return layer(x_BTD, encoded_BSD, self_spec, cross_spec, positions_BT), None


def _maybe_remat(cls, policy: str):
  if policy not in REMAT_POLICIES:
    raise ValueError(f"model.remat_policy={policy!r} is not one of {sorted(REMAT_POLICIES)}")
  if policy == "none":
    return cls
  return nn.remat(cls, policy=REMAT_POLICIES[policy], prevent_cse=False)


class TransformerStack(nn.Module):
  """`num_layers` TransformerLayers, unrolled (`layer_{i}`) or scanned (`layers/layer`)."""

  spec: LayerSpec
  num_layers: int
  scan_layers: bool = False
  remat_policy: str = "none"

  @nn.compact
  def __call__(
      self,
      x_BTD: Array,
      *,
      encoded_BSD: Array | None = None,
      self_spec: AttentionSpec | None = None,
      cross_spec: AttentionSpec | None = None,
      positions_BT: Array | None = None,
      train: bool = False,
      decode: bool = False,
  ) -> Array:
    """`self_spec` / `cross_spec` describe what attends to what (None: everything)."""
    args = (encoded_BSD, self_spec, cross_spec, positions_BT)
    if self.scan_layers:
      if decode:
        raise ValueError(
            "decoding needs model.scan_layers=False: the KV cache is kept " "per unrolled layer"
        )
      scanned = nn.scan(
          _ScannedLayer,
          variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast,) * len(args),
          length=self.num_layers,
          metadata_params={nn.PARTITION_NAME: axes.LAYERS},
      )
      x_BTD, _ = scanned(
          self.spec, train=train, decode=decode, remat_policy=self.remat_policy, name="layers"
      )(x_BTD, *args)
      return x_BTD
    layer_cls = _maybe_remat(TransformerLayer, self.remat_policy)
    for i in range(self.num_layers):
      x_BTD = layer_cls(self.spec, train=train, decode=decode, name=f"layer_{i}")(x_BTD, *args)
    return x_BTD
