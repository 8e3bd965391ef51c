"""Pure train and eval steps: gradient accumulation, non-finite guard, metrics as sums.

The loop binds the static arguments (`apply_fn`, `tx`, ...) with functools.partial and jits
once with explicit shardings and the state donated; nothing here knows about meshes.
`apply_fn(params, batch, train, rng) -> logits` is built by the loop from the model.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tx_jax.train import losses
from tx_jax.train.state import TrainState

ApplyFn = Callable[[Any, dict, bool, jax.Array], jax.Array]

# train_step's metrics, in the order of the packed vector the loop pulls.
METRIC_NAMES = (
    "loss_sum", "nll_sum", "correct_sum", "weight_sum", "grad_norm", "nonfinite", "learning_rate"
)


def pack_metrics(metrics: dict) -> jax.Array:
  """train_step's scalar metrics as one float32 vector, in METRIC_NAMES order.

  The loop then copies one buffer to the host per step instead of seven, since on a small
  CPU every pull takes host time from the step.
  Float32 holds every value exactly: the sums are float32 already, nonfinite is 0 or 1.
  """
  if set(metrics) != set(METRIC_NAMES):
    raise ValueError(f"metrics {sorted(metrics)} are not METRIC_NAMES {sorted(METRIC_NAMES)}")
  return jnp.stack([metrics[k].astype(jnp.float32) for k in METRIC_NAMES])


def split_micro_batches(batch: dict, k: int) -> dict:
  """[B, ...] -> [k, B/k, ...], micro-batch i taking rows i, i+k, ... (even over data shards)."""

  def split(x):
    if x.shape[0] % k:
      raise ValueError(
          f"global batch size {x.shape[0]} is not divisible by "
          f"config.train.grad_accum_steps={k}"
      )
    return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def _grad_sums(
    params: Any,
    batch: dict,
    rng: jax.Array,
    apply_fn: ApplyFn,
    label_smoothing: float,
    z_loss: float,
) -> tuple[dict, Any]:
  """Sums of the batch's losses and the gradient of the (unnormalised) loss sum."""

  def loss_fn(p):
    logits = apply_fn(p, batch, True, rng)
    sums = losses.loss_sums(logits, batch, label_smoothing, z_loss)
    return sums["loss_sum"], sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(params)
  return sums, grads


def train_step(
    state: TrainState,
    batch: dict,
    *,
    apply_fn: ApplyFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    grad_accum_steps: int = 1,
) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch; skips the update when anything is non-finite.

  The loss is sum(loss * weights) / sum(weights) over the whole global batch, also with
  k accumulated micro-batches (their gradient sums are added, then divided once).
  """
  rng = jax.random.fold_in(state.rng, state.step)
  if grad_accum_steps == 1:
    sums, grads = _grad_sums(state.params, batch, rng, apply_fn, label_smoothing, z_loss)
  else:
    micro = split_micro_batches(batch, grad_accum_steps)

    def body(carry, xs):
      i, mb = xs
      s, g = _grad_sums(
          state.params, mb, jax.random.fold_in(rng, i), apply_fn, label_smoothing, z_loss
      )
      return jax.tree.map(jnp.add, carry, (s, g)), None

    zeros = jax.tree.map(
        jnp.zeros_like,
        (
            {
                k: jnp.zeros((), jnp.float32)
                for k in ("loss_sum", "nll_sum", "correct_sum", "weight_sum")
            },
            state.params,
        ),
    )
    (sums, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum_steps), micro))
  denom = jnp.maximum(sums["weight_sum"], 1.0)
  grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
  grad_norm = optax.global_norm(grads)
  updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  # One bad batch must not poison params or moments: keep the old ones and count the skip.
  ok = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
  new_state = state.replace(
      step=state.step + 1,
      params=keep(new_params, state.params),
      opt_state=keep(new_opt_state, state.opt_state),
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
  )
  metrics = dict(
      sums,
      grad_norm=grad_norm,
      nonfinite=(~ok).astype(jnp.int32),
      learning_rate=schedule(state.step - state.skipped),
  )
  return new_state, metrics


def eval_step(params: Any, batch: dict, *, apply_fn: ApplyFn) -> dict:
  """Sums of plain (unsmoothed) NLL and correct predictions over a batch; weights mask padding."""
  logits = apply_fn(params, batch, False, jax.random.PRNGKey(0))
  return losses.loss_sums(logits, batch)
