"""Losses over the batch contract: weighted token / label cross-entropy, label smoothing, z-loss.

Every function returns *sums* plus the weight denominator, so that gradient accumulation,
data parallelism and padded eval batches all divide once, by the true total weight.
"""

import jax
import jax.numpy as jnp


def cross_entropy(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> tuple[jax.Array, jax.Array]:
  """Per-position (smoothed loss + z-loss, plain NLL) for integer targets; all in float32.

  Smoothing is uniform over the vocabulary (target q = (1-eps)*onehot + eps/V), as in
  Szegedy et al. and the Transformer paper; z-loss adds z_loss * log(Z)^2 (PaLM).
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_z - target_logit
  loss = nll
  if label_smoothing:
    # -sum_v q_v log p_v = log Z - (1-eps) * logit_target - eps * mean_v logit_v
    smooth = log_z - jnp.mean(logits, axis=-1)
    loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
  if z_loss:
    loss = loss + z_loss * jnp.square(log_z)
  return loss, nll


def loss_sums(
    logits: jax.Array, batch: dict, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> dict[str, jax.Array]:
  """Weighted sums of loss, nll and correct predictions plus the weight total.

  Reads `labels` (classification, logits [B, C]) when present, else `targets` (logits
  [B, T, V]); `weights` masks padding and unselected MLM positions.
  """
  targets = batch["labels"] if "labels" in batch else batch["targets"]
  weights = batch["weights"].astype(jnp.float32)
  if logits.shape[:-1] != targets.shape:
    raise ValueError(
        f"logits shape {logits.shape} does not match targets shape "
        f"{targets.shape} (+ a class/vocab axis)"
    )
  loss, nll = cross_entropy(logits, targets, label_smoothing, z_loss)
  # Top-1 accuracy as "the target's logit is the largest": a max-reduce, which XLA shares
  # with logsumexp's, where argmax would add a second (value, index) pass over [tokens,
  # vocab]. On an exact tie for the largest logit this counts the target as correct where
  # argmax picks the lowest index.
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  return {
      "loss_sum": jnp.sum(loss * weights),
      "nll_sum": jnp.sum(nll * weights),
      "correct_sum": jnp.sum(correct * weights),
      "weight_sum": jnp.sum(weights),
  }
