"""TrainState and the function that initialises it (jitted with out_shardings by the loop)."""

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class TrainState(flax.struct.PyTreeNode):
  """Everything a step changes: params, optimizer state, step, rng and the skip counter."""

  step: jax.Array  # int32: batches consumed (updates applied + updates skipped)
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2] base key; step s uses fold_in(rng, s), so resume is exact
  skipped: jax.Array  # int32: updates skipped because the loss or a gradient was non-finite


def make_init_fn(
    init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation, seed: int
) -> Callable[[], TrainState]:
  """A no-argument function building the initial state; params may carry logical boxes."""

  def init() -> TrainState:
    params_rng, state_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = nn.unbox(init_params(params_rng))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=state_rng,
        skipped=jnp.zeros((), jnp.int32),
    )

  return init

