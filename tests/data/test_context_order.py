"""data/context_order.py: the zig-zag order the trainer hands causal rows over in on a
sequence mesh. The permutation gives device d the chunks d and 2n-1-d and evens out causal
work; `to_zigzag` moves a task's whole causal stream together, pads, fills what the model can
no longer derive from the order, and records each token's natural index. A model fed rows in
that order with their indices gives every token the logits it gets in natural order."""

import jax
import numpy as np
import pytest

from tests.test_sharded_steps import _batch, _family_config
from tx_jax import models
from tx_jax.data.context_order import CAUSAL_STREAMS, causal_work, to_zigzag, zigzag_permutation


def test_device_d_holds_chunks_d_and_2n_minus_1_minus_d():
  order = zigzag_permutation(16, 4).reshape(4, 2, 2)  # [device, slot, token in chunk]
  for d in range(4):
    np.testing.assert_array_equal(order[d, 0], [2 * d, 2 * d + 1])
    np.testing.assert_array_equal(order[d, 1], [2 * (7 - d), 2 * (7 - d) + 1])


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_zigzag_evens_causal_work_and_the_natural_order_does_not(devices):
  balanced = causal_work(zigzag_permutation(1024, devices), devices)
  natural = causal_work(np.arange(1024), devices)
  assert max(balanced) <= 1.2 * np.mean(balanced), balanced
  assert max(natural) > 1.2 * np.mean(natural), natural  # what the order is for


def test_a_length_the_order_cannot_split_is_refused():
  with pytest.raises(ValueError, match="divisible by 2 x 4; got 12"):
    zigzag_permutation(12, 4)


def test_the_stream_moves_together_padded_with_its_natural_indices():
  rows, length = 2, 6
  batch = {
      "inputs": np.arange(12, dtype=np.int32).reshape(rows, length) + 10,
      "targets": np.arange(12, dtype=np.int32).reshape(rows, length) + 100,
      "weights": np.ones((rows, length), np.float32),
      "segment_ids": np.ones((rows, length), np.int32),
      "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
      "labels": np.array([3, 4], np.int32),  # not [B, T]: not part of the stream
  }
  got = to_zigzag(batch, "lm", devices=2)  # 6 tokens pad to 8
  order = zigzag_permutation(8, 2)
  np.testing.assert_array_equal(got["token_index"], np.tile(order, (rows, 1)))
  real = order < length
  np.testing.assert_array_equal(got["inputs"][:, real], batch["inputs"][:, order[real]])
  np.testing.assert_array_equal(got["targets"][:, real], batch["targets"][:, order[real]])
  for name in ("inputs", "targets", "weights", "segment_ids"):  # padding by the contract
    assert not got[name][:, ~real].any(), name
  np.testing.assert_array_equal(got["labels"], batch["labels"])


def test_absent_segment_ids_and_positions_are_filled_before_the_order_hides_them():
  batch = {"inputs": np.ones((1, 8), np.int32), "targets": np.ones((1, 8), np.int32)}
  got = to_zigzag(batch, "lm", devices=2)
  order = zigzag_permutation(8, 2)
  np.testing.assert_array_equal(got["positions"][0], order)
  np.testing.assert_array_equal(got["segment_ids"][0], np.ones(8))


def test_bidirectional_tasks_and_one_device_keep_natural_order():
  batch = {"inputs": np.ones((1, 8), np.int32)}
  assert to_zigzag(batch, "mlm", devices=4).keys() == batch.keys()
  assert to_zigzag(batch, "lm", devices=1).keys() == batch.keys()


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_a_model_fed_zigzag_rows_gives_each_token_its_natural_logits(family):
  """RoPE and causality (llama), T5's relative bias and cross-attention (t5): nothing in the
  model depends on the order once positions and indices come with the tokens."""
  config = _family_config(family)
  batch = _batch(config)
  module = models.build(config.model)
  args, kwargs = models.model_inputs(config.model, batch)
  params = module.init(jax.random.key(0), *args, **kwargs)["params"]

  def logits(b):
    args, kwargs = models.model_inputs(config.model, b)
    return np.asarray(module.apply({"params": params}, *args, **kwargs))

  want = logits(batch)
  ordered = to_zigzag(batch, config.data.task, devices=4)
  order = zigzag_permutation(want.shape[1], 4)
  np.testing.assert_allclose(logits(ordered), want[:, order], rtol=1e-5, atol=1e-5)
  # The check can fail: without the indices, causality follows the new order.
  index_key = CAUSAL_STREAMS[config.data.task].index
  without = {k: v for k, v in ordered.items() if k != index_key}
  assert not np.allclose(logits(without), want[:, order], atol=1e-5)
