"""Whole models trained a few steps with `blockwise` attention give the losses of `dense`.

Blocks are shrunk (4 queries x 3 keys) so that packed, padded rows of 11 tokens span
several blocks of unequal sizes, with skipped ones.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.models.variants import VARIANTS
from tx_jax.models import build, model_inputs
from tx_jax.train.losses import loss_sums

B, T, S, STEPS = 2, 11, 9, 3


def _rows(length, seed, packed=True):
  """Token ids, segment ids (two packed documents, or one, then padding) and positions."""
  rng = np.random.default_rng(seed)
  split, end = (length // 2 if packed else length), length - 2
  segments = np.array([[1] * min(split, end) + [2] * (end - split) + [0] * (length - end)] * B)
  positions = np.array([list(range(split)) + list(range(length - split))] * B) * (segments > 0)
  ids = rng.integers(4, 53, (B, length)) * (segments > 0)
  return (jnp.asarray(x, jnp.int32) for x in (ids, segments, positions))


def _batch(family, packed=True):
  ids, segments, positions = _rows(T, 0, packed)
  targets = jnp.roll(ids, -1, axis=1)
  weights = (segments > 0).astype(jnp.float32)
  labels = dict(targets=targets, weights=weights)
  if family == "decoder":
    return dict(inputs=ids, segment_ids=segments, positions=positions, **labels)
  if family == "encoder":
    types = jnp.zeros_like(ids)
    return dict(
        inputs=ids, token_type_ids=types, segment_ids=segments, positions=positions, **labels
    )
  src, src_segments, src_positions = _rows(S, 1, packed)
  return dict(
      encoder_inputs=src,
      encoder_segment_ids=src_segments,
      encoder_positions=src_positions,
      decoder_inputs=ids,
      decoder_segment_ids=segments,
      decoder_positions=positions,
      **labels,
  )


def _train_losses(config):
  module = build(config)
  batch = _batch(config.family, config.packed_inputs)
  args, kwargs = model_inputs(config, batch)
  params = nn.unbox(module.init(jax.random.PRNGKey(0), *args, **kwargs)["params"])
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(params):
      sums = loss_sums(module.apply({"params": params}, *args, **kwargs), batch)
      return sums["loss_sum"] / sums["weight_sum"]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = optimizer.init(params), []
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return np.array(losses)


# Every family and position scheme: learned, RoPE + GQA, ALiBi, T5 relative (decoder-only
# and encoder-decoder), BERT, the sinusoidal encoder-decoder.
FAMILIES = ["gpt2", "llama", "alibi", "t5_decoder_only", "bert", "t5", "transformer"]


@pytest.mark.slow  # about 40-120 s each on a loaded 2-core CPU, mostly compilation
@pytest.mark.parametrize("name", FAMILIES)
def test_blockwise_trains_like_dense(name):
  config = dataclasses.replace(VARIANTS[name], blockwise_block_q=4, blockwise_block_k=3)
  dense = _train_losses(dataclasses.replace(config, attention_backend="dense"))
  blockwise = _train_losses(dataclasses.replace(config, attention_backend="blockwise"))
  assert np.all(np.isfinite(dense)) and dense[-1] < dense[0]  # it really trains
  np.testing.assert_allclose(blockwise, dense, rtol=1e-5)


@pytest.mark.slow
def test_blockwise_under_scanned_rematerialised_layers():
  """The description passes through nn.scan (broadcast) and nn.remat like a tensor did."""
  config = dataclasses.replace(
      VARIANTS["llama"],
      scan_layers=True,
      remat_policy="full",
      blockwise_block_q=4,
      blockwise_block_k=3,
  )
  dense = _train_losses(dataclasses.replace(config, attention_backend="dense"))
  blockwise = _train_losses(dataclasses.replace(config, attention_backend="blockwise"))
  np.testing.assert_allclose(blockwise, dense, rtol=1e-5)
