"""Position-wise feed-forward blocks: Mlp (ReLU / GELU) and GatedMlp (GeGLU / SwiGLU)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

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


def _dense(
    features: int, axes: tuple[str, str], use_bias: bool, init, dtype, param_dtype, name: str
) -> nn.Dense:
  return nn.Dense(
      features,
      use_bias=use_bias,
      kernel_init=nn.with_logical_partitioning(init, axes),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
      dtype=dtype,
      param_dtype=param_dtype,
      name=name,
  )


class Mlp(nn.Module):
  """x -> wo(dropout(act(wi(x)))): the paper's ReLU FFN, BERT / GPT-2's GELU FFN."""

  hidden: int
  activation: str = "relu"
  use_bias: bool = True
  inner_dropout_rate: float = 0.0  # T5 drops out after the activation
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  output_init: nn.initializers.Initializer | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BTD: Array, *, train: bool = False) -> Array:
    dim = x_BTD.shape[-1]
    act = get_activation(self.activation)
    h_BTF = act(
        _dense(
            self.hidden,
            ("embed", "mlp"),
            self.use_bias,
            self.kernel_init,
            self.dtype,
            self.param_dtype,
            "wi",
        )(x_BTD)
    )
    h_BTF = nn.with_logical_constraint(h_BTF, ("act_batch", "act_len", "act_mlp"))
    h_BTF = nn.Dropout(self.inner_dropout_rate)(h_BTF, deterministic=not train)
    return _dense(
        dim,
        ("mlp", "embed"),
        self.use_bias,
        self.output_init or self.kernel_init,
        self.dtype,
        self.param_dtype,
        "wo",
    )(h_BTF)


class GatedMlp(nn.Module):
  """x -> wo(act(wi_0(x)) * wi_1(x)): GeGLU (T5 v1.1) with gelu_tanh, SwiGLU (LLaMA) with silu."""

  hidden: int
  activation: str = "silu"
  use_bias: bool = False
  inner_dropout_rate: float = 0.0
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  output_init: nn.initializers.Initializer | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BTD: Array, *, train: bool = False) -> Array:
    dim = x_BTD.shape[-1]
    act = get_activation(self.activation)
    gate_BTF = act(
        _dense(
            self.hidden,
            ("embed", "mlp"),
            self.use_bias,
            self.kernel_init,
            self.dtype,
            self.param_dtype,
            "wi_0",
        )(x_BTD)
    )
    up_BTF = _dense(
        self.hidden,
        ("embed", "mlp"),
        self.use_bias,
        self.kernel_init,
        self.dtype,
        self.param_dtype,
        "wi_1",
    )(x_BTD)
    h_BTF = nn.with_logical_constraint(gate_BTF * up_BTF, ("act_batch", "act_len", "act_mlp"))
    h_BTF = nn.Dropout(self.inner_dropout_rate)(h_BTF, deterministic=not train)
    return _dense(
        dim,
        ("mlp", "embed"),
        self.use_bias,
        self.output_init or self.kernel_init,
        self.dtype,
        self.param_dtype,
        "wo",
    )(h_BTF)
