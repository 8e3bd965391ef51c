"""Losses against numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.train import losses


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothed_cross_entropy_matches_numpy(eps):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, (3, 5)).astype(np.int32)
  weights = rng.integers(0, 2, (3, 5)).astype(np.float32)
  q = np.full((3, 5, 7), eps / 7, np.float64)
  np.put_along_axis(q, targets[..., None], 1 - eps + eps / 7, axis=-1)
  ref = -(q * _np_log_softmax(logits.astype(np.float64))).sum(-1)
  sums = losses.loss_sums(
      jnp.asarray(logits), {"targets": targets, "weights": weights}, label_smoothing=eps
  )
  np.testing.assert_allclose(float(sums["loss_sum"]), (ref * weights).sum(), rtol=1e-5)
  nll = -np.take_along_axis(_np_log_softmax(logits.astype(np.float64)), targets[..., None], -1)
  np.testing.assert_allclose(float(sums["nll_sum"]), (nll[..., 0] * weights).sum(), rtol=1e-5)
  correct = (logits.argmax(-1) == targets) * weights
  assert float(sums["correct_sum"]) == correct.sum()
  assert float(sums["weight_sum"]) == weights.sum()


def test_z_loss_and_classification_labels():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(4, 3)).astype(np.float32)
  labels = np.array([0, 2, 1, 1], np.int32)
  weights = np.array([1, 1, 0, 1], np.float32)
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  nll = log_z - logits[np.arange(4), labels]
  sums = losses.loss_sums(jnp.asarray(logits), {"labels": labels, "weights": weights}, z_loss=1e-2)
  np.testing.assert_allclose(
      float(sums["loss_sum"]), ((nll + 1e-2 * log_z**2) * weights).sum(), rtol=1e-6
  )


def test_shape_mismatch_is_named():
  with pytest.raises(ValueError, match="does not match targets shape"):
    losses.loss_sums(
        jnp.zeros((2, 3, 5)),
        {"targets": np.zeros((2, 4), np.int32), "weights": np.ones((2, 4), np.float32)},
    )
