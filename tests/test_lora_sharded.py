"""LoRA trains identically on every mesh: two sharded steps (the trainer's AdamW with the frozen
base) equal the same steps on one device, and the adapters sit where the rules put them: A
like its kernel's input dims, B like its output dims, the rank axis replicated."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import test_sharded_steps as sharded
from tx_jax import models, sharding
from tx_jax.train import loop, optimizers, state as state_lib, steps

pytestmark = pytest.mark.slow

MESHES = [(2, 2, 2), (1, 2, 4), (1, 8, 1)]
TARGETS = {"gpt": ("qkv", "output", "mlp_up"), "llama": ("query", "qkv", "mlp_gate", "mlp_down")}
EXPECTED_AXIS = {**sharded.EXPECTED_AXIS, "lora_rank": None}


def _config(family: str):
  config = sharded._family_config(family)  # pylint: disable=protected-access
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  config.model.lora.update(rank=4, alpha=8.0, dropout=0.1, targets=TARGETS[family])
  config.optimizer.learning_rate, config.optimizer.weight_decay = 1e-2, 0.0
  config.schedule.name, config.schedule.warmup_steps = "constant", 0
  return config


def _parts(config):
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  batch = sharded._batch(config)  # pylint: disable=protected-access
  example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in batch.items()}

  def init_params(rng):
    args, kwargs = models.model_inputs(config.model, example)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  init_fn = state_lib.make_init_fn(init_params, tx, config.seed)
  step = functools.partial(
      steps.train_step, apply_fn=loop.make_apply_fn(module, config.model), tx=tx, schedule=schedule
  )
  return init_params, init_fn, step, batch


def _two_steps(step, state, batch):
  state, _ = step(state, batch)
  return step(state, batch)


@pytest.fixture(scope="module", params=sorted(TARGETS))
def reference(request):
  config = _config(request.param)
  _, init_fn, step, batch = _parts(config)
  state0 = jax.jit(init_fn)()
  state2, metrics = jax.jit(functools.partial(_two_steps, step))(state0, batch)
  return request.param, config, jax.device_get(state0), jax.device_get(state2), metrics


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_lora_equals_single_device_lora(reference, mesh_shape):
  family, config, ref0, ref2, ref_metrics = reference
  config = config.copy_and_resolve_references()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  sharding.validate(config, jax.device_count())
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  init_params, init_fn, step, batch = _parts(config)
  boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  shardings = sharding.state_shardings(jax.eval_shape(init_fn), boxed, mesh, rules)
  state0 = jax.jit(init_fn, out_shardings=shardings)()
  names = jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
  )[0]
  adapters = 0
  for (path, box), array in zip(names, jax.tree_util.tree_leaves(state0.params)):
    expected = tuple(EXPECTED_AXIS[n] for n in box.names)
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    assert spec == expected, (path, spec, expected)
    adapters += "lora_rank" in box.names
  assert adapters >= 2 * len(TARGETS[family])

  jstep = jax.jit(
      sharding.with_rules(functools.partial(_two_steps, step), mesh, rules),
      in_shardings=(shardings, sharding.batch_sharding(mesh)),
      out_shardings=(shardings, sharding.replicated(mesh)),
  )
  state2, metrics = jstep(state0, jax.device_put(batch, sharding.batch_sharding(mesh)))
  loss = float(metrics["loss_sum"] / metrics["weight_sum"])
  ref_loss = float(ref_metrics["loss_sum"] / ref_metrics["weight_sum"])
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  mask = jax.tree.leaves(optimizers.trainable_mask(ref0.params, config.model.lora))
  got, want = jax.tree.leaves(jax.device_get(state2.params)), jax.tree.leaves(ref2.params)
  for trained, init, g, w in zip(mask, jax.tree.leaves(ref0.params), got, want):
    if trained:
      assert np.max(np.abs(w - init)) > 0  # the adapters moved ...
      np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)  # ... as on one device
    else:
      assert g.tobytes() == init.tobytes()  # the base did not, on any mesh
