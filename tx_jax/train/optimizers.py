"""optax optimizers from config: AdamW / Adafactor, global-norm clipping, weight-decay masks,
and LoRA's frozen base (only the adapters and config.model.lora.also_train get state)."""

import math
import re
from typing import Any

import jax
import ml_collections
import optax

from tx_jax.layers.lora import trainable_mask
from tx_jax.pytree import path_str
from tx_jax.train import schedules

OPTIMIZERS = ("adamw", "adafactor")


def decay_mask(params: Any, no_decay: tuple[str, ...]) -> Any:
  """True for parameters that are decayed: those whose path matches none of `no_decay`."""
  patterns = [re.compile(p) for p in no_decay]
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(p.search(path_str(path)) for p in patterns), params
  )


def freeze(params: Any, lora: ml_collections.ConfigDict) -> Any:
  """`params` with the frozen ones behind stop_gradient, so no weight gradient is computed."""
  if lora.rank <= 0:
    return params
  mask = trainable_mask(params, lora)
  return jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, mask)


def validate(opt: ml_collections.ConfigDict) -> None:
  """The optimizer section on its own, before anything is built (tx_jax.validation runs it)."""
  if opt.name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name={opt.name!r}: expected one of {OPTIMIZERS}")
  # A rate <= 0 or NaN trains without an error: ascent or NaN losses, and exit 0.
  if not (math.isfinite(opt.learning_rate) and opt.learning_rate > 0):
    raise ValueError(
        f"config.optimizer.learning_rate={opt.learning_rate}: must be a finite number > 0"
    )
  if opt.grad_clip_norm < 0:
    raise ValueError(f"config.optimizer.grad_clip_norm={opt.grad_clip_norm}: must be >= 0")


def build_optimizer(
    config: ml_collections.ConfigDict,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimizer (clipping included) and its schedule, from the optimizer/schedule sections."""
  validate(config.optimizer)
  opt = config.optimizer
  schedule = schedules.build_schedule(
      config.schedule, opt.learning_rate, config.train.steps, config.model.d_model
  )
  mask = lambda params: decay_mask(params, tuple(opt.no_decay))  # noqa: E731
  if opt.name == "adamw":
    tx = optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=mask
    )
  elif opt.name == "adafactor":
    tx = optax.adafactor(
        schedule,
        decay_rate=opt.adafactor_decay_rate,
        clipping_threshold=opt.adafactor_clipping_threshold or None,
        multiply_by_parameter_scale=opt.adafactor_param_scale,
        factored=opt.adafactor_factored,
        weight_decay_rate=opt.weight_decay or None,
        weight_decay_mask=mask,
    )
  if opt.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip_norm), tx)
  lora = config.model.lora
  if lora.rank > 0:
    # set_to_zero keeps no state: the frozen base holds no moments, and its (stop_gradient'ed,
    # zero) gradients add nothing to the clipped norm.
    labels = lambda params: jax.tree.map(  # noqa: E731
        lambda t: "train" if t else "frozen", trainable_mask(params, lora)
    )
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule
