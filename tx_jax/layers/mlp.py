"""Position-wise feed-forward blocks: Mlp (ReLU / GELU) and GatedMlp (GeGLU / SwiGLU)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes, ops
from tx_jax.layers.linear import Linear
from tx_jax.layers.lora import LoraSpec

Array = jnp.ndarray

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),  # BERT: the exact erf form
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),  # GPT-2 / T5 v1.1 "gelu_new"
    "silu": nn.silu,  # SwiGLU's gate (LLaMA)
}


def get_activation(name: str) -> Callable[[Array], Array]:
  """Activation by name, with an error listing the accepted ones."""
  if name not in ACTIVATIONS:
    raise ValueError(f"model.mlp_activation={name!r} is not one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]


class _FeedForward(nn.Module):
  """Fields and projections shared by Mlp and GatedMlp; subclasses define the hidden layer."""

  hidden: int
  activation: str = "relu"
  use_bias: bool = True
  inner_dropout_rate: float = 0.0  # T5 drops out after the activation
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  output_init: nn.initializers.Initializer | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernels: str = ops.PLAIN  # which `layers.ops` kernel set multiplies
  lora: LoraSpec | None = None  # low-rank adapters on the projections its targets name

  def _up(self, x_BTD: Array, name: str, train: bool) -> Array:
    """[B,T,D] -> [B,T,F] through the kernel `name` (logical axes embed x mlp)."""
    up = self._linear(self.hidden, (axes.EMBED, axes.MLP), self.kernel_init, name)
    return up(x_BTD, train=train)

  def _down(self, h_BTF: Array, dim: int, train: bool) -> Array:
    """Constrain, drop out, then project the hidden layer back to width `dim` ("wo")."""
    h_BTF = axes.constrain(h_BTF, "BTF")
    h_BTF = nn.Dropout(self.inner_dropout_rate)(h_BTF, deterministic=not train)
    init = self.output_init or self.kernel_init
    return self._linear(dim, (axes.MLP, axes.EMBED), init, "wo")(h_BTF, train=train)

  def _linear(self, features: int, kernel_axes: tuple[str, str], init, name: str) -> Linear:
    return Linear(
        features,
        kernel_axes,
        use_bias=self.use_bias,
        kernel_init=init,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernels=self.kernels,
        lora=self.lora,
        name=name,
    )


class Mlp(_FeedForward):
  """x -> wo(dropout(act(wi(x)))): the paper's ReLU FFN, BERT / GPT-2's GELU FFN."""

  @nn.compact
  def __call__(self, x_BTD: Array, *, train: bool = False) -> Array:
    act = get_activation(self.activation)
    return self._down(act(self._up(x_BTD, "wi", train)), x_BTD.shape[-1], train)


class GatedMlp(_FeedForward):
  """x -> wo(act(wi_0(x)) * wi_1(x)): GeGLU (T5 v1.1) with gelu_tanh, SwiGLU (LLaMA) with silu."""

  activation: str = "silu"
  use_bias: bool = False

  @nn.compact
  def __call__(self, x_BTD: Array, *, train: bool = False) -> Array:
    act = get_activation(self.activation)
    h_BTF = act(self._up(x_BTD, "wi_0", train)) * self._up(x_BTD, "wi_1", train)
    return self._down(h_BTF, x_BTD.shape[-1], train)
