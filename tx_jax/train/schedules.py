"""Learning-rate schedules: the Transformer paper's, inverse square root, warm-up + decay."""

import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("constant", "paper", "inverse_sqrt", "warmup_cosine", "warmup_linear")


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """Vaswani et al. (2017) eq. 3: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""

  def schedule(count):
    # optax passes the number of updates already applied; the paper counts from step 1.
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

  return schedule


def inverse_sqrt_schedule(warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """T5's schedule: scale / sqrt(max(step, warmup)), constant during warm-up."""

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * jnp.maximum(step, float(warmup_steps)) ** -0.5

  return schedule


def build_schedule(
    schedule_cfg: ml_collections.ConfigDict,
    learning_rate: float,
    total_steps: int,
    d_model: int = 0,
) -> optax.Schedule:
  """The optax schedule named by `config.schedule.name`; `learning_rate` is its peak/scale.

  `d_model` (config.model.d_model) is read by the paper's schedule only.
  """
  name = schedule_cfg.name
  warmup = schedule_cfg.warmup_steps
  if name not in SCHEDULES:
    raise ValueError(f"config.schedule.name={name!r}: expected one of {SCHEDULES}")
  if warmup < 0:
    raise ValueError(f"config.schedule.warmup_steps={warmup}: must be >= 0")
  if name == "constant":
    if warmup == 0:
      return optax.constant_schedule(learning_rate)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup), optax.constant_schedule(learning_rate)],
        [warmup],
    )
  if name == "paper":
    if warmup <= 0:
      raise ValueError(f"config.schedule.warmup_steps={warmup}: the paper's schedule needs > 0")
    if d_model <= 0:
      raise ValueError(f"the paper's schedule needs config.model.d_model > 0, got {d_model}")
    return paper_schedule(d_model, warmup, learning_rate)
  if name == "inverse_sqrt":
    return inverse_sqrt_schedule(max(warmup, 1), learning_rate)
  decay_steps = schedule_cfg.decay_steps or total_steps
  if decay_steps <= warmup:
    raise ValueError(
        f"config.schedule.decay_steps={decay_steps} (0 means train.steps="
        f"{total_steps}) must exceed warmup_steps={warmup}"
    )
  end_value = learning_rate * schedule_cfg.end_factor
  if name == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, decay_steps, end_value)
  if name == "warmup_linear":
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, learning_rate, warmup),
            optax.linear_schedule(learning_rate, end_value, decay_steps - warmup),
        ],
        [warmup],
    )
  raise AssertionError(name)  # unreachable: the name was validated above
