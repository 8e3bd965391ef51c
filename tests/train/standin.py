"""A tiny stand-in language model for trainer unit tests (independent of tx_jax.models)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class TinyLM(nn.Module):
  """Embedding -> LayerNorm -> dropout -> Dense(relu) -> Dense(vocab); per-token, no attention."""

  vocab: int = 11
  width: int = 16
  dropout: float = 0.0
  dtype: jnp.dtype = jnp.float32  # compute
  param_dtype: jnp.dtype = jnp.float32  # storage

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x = nn.Embed(self.vocab, self.width, name="embed", **kw)(tokens)
    x = nn.LayerNorm(name="norm", **kw)(x)
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    x = nn.relu(nn.Dense(self.width, name="hidden", **kw)(x))
    return nn.Dense(self.vocab, name="out", **kw)(x).astype(jnp.float32)


def apply_fn_for(module: nn.Module):
  """The (params, batch, train, rng) -> logits adapter that the steps expect."""

  def apply_fn(params, batch, train, rng):
    return module.apply({"params": params}, batch["inputs"], train=train, rngs={"dropout": rng})

  return apply_fn


def lm_batch(seed: int = 0, batch: int = 8, length: int = 6, vocab: int = 11) -> dict:
  """A random LM batch following the batch contract, with some padding."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, vocab, (batch, length)).astype(np.int32)
  weights = np.ones((batch, length), np.float32)
  weights[:, -2:] = rng.integers(0, 2, (batch, 2))
  return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), "weights": weights}


def init_params(module: nn.Module, batch: dict, seed: int = 0):
  """Parameters of the stand-in for a batch."""
  return module.init(jax.random.PRNGKey(seed), jnp.asarray(batch["inputs"]))["params"]
