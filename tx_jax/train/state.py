"""TrainState and its sharded initialisation (eval_shape -> shardings -> jit(out_shardings))."""

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tx_jax.train import optimizers


class TrainState(flax.struct.PyTreeNode):
  """Everything a step changes: params, optimizer state, step, rng and the skip counter."""

  step: jax.Array  # int32: batches consumed (updates applied + updates skipped)
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2] base key; step s uses fold_in(rng, s), so resume is exact
  skipped: jax.Array  # int32: updates skipped because the loss or a gradient was non-finite


def make_init_fn(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
                 seed: int) -> Callable[[], TrainState]:
  """A no-argument function building the initial state; params may carry logical boxes."""

  def init() -> TrainState:
    params_rng, state_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = nn.unbox(init_params(params_rng))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=state_rng, skipped=jnp.zeros((), jnp.int32))

  return init


def opt_state_shardings(opt_state: Any, params: Any, param_shardings: Any,
                        replicated: jax.sharding.Sharding) -> Any:
  """Shard optimizer-state leaves like the parameter they mirror (same path suffix and shape).

  Leaves that mirror no parameter (counts, Adafactor's factored row/column moments) are
  replicated: they are small.
  """
  by_path = {}
  for (path, p), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree_util.tree_leaves(param_shardings)):
    by_path[optimizers.path_str(path)] = (p.shape, s)

  def pick(path, leaf):
    keys = optimizers.path_str(path).split("/")
    for start in range(len(keys)):
      hit = by_path.get("/".join(keys[start:]))
      if hit is not None and hit[0] == leaf.shape:
        return hit[1]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, opt_state)


def state_shardings(abstract_state: TrainState, param_shardings: Any,
                    replicated: jax.sharding.Sharding) -> TrainState:
  """Shardings for every TrainState leaf given the parameters' shardings."""
  return TrainState(
      step=replicated, params=param_shardings,
      opt_state=opt_state_shardings(abstract_state.opt_state, abstract_state.params,
                                    param_shardings, replicated),
      rng=replicated, skipped=replicated)


def count_params(params: Any) -> int:
  """Number of scalars in a parameter tree (abstract or concrete)."""
  return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
