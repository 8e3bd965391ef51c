"""The CPU data-parallel gradient summed as one flat buffer (tx_jax.train.data_parallel).

The trainer's step on a pure data-parallel CPU mesh sums the gradient inside shard_map with
one psum per dtype instead of jit's all-reduce per leaf. It must compute the partitioner's
step to float rounding, compile to a single all-reduce, and stay off wherever it would
change what the step computes (dropout, sharded params, model axes).
"""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import gpt
from tests.tiers import slow_except
from tests.train import batches
from tx_jax import models, sharding
from tx_jax.train import data_parallel, optimizers, run, steps


def _mesh(data: int, fsdp: int = 1, tensor: int = 1) -> Mesh:
  config = ml_collections.ConfigDict(
      {"data": data, "fsdp": fsdp, "sequence": 1, "tensor": tensor, "cpu_devices": 0}
  )
  return sharding.make_mesh(config, jax.devices()[: data * fsdp * tensor])


def test_psum_flat_equals_psum_per_leaf_bit_for_bit_for_every_dtype():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  rng = np.random.default_rng(0)
  tree = {
      "w": rng.normal(size=(4, 3, 5)).astype(np.float32),
      "b": rng.normal(size=(4, 7)).astype(jnp.bfloat16),
      "n": rng.integers(0, 9, size=(4,)).astype(np.int32),
      "s": rng.normal(size=(4, 1)).astype(np.float32),
  }

  def reduce(flat: bool):
    if flat:
      fn = lambda t: data_parallel.psum_flat(t, ("data",))  # noqa: E731
    else:
      fn = lambda t: jax.lax.psum(t, "data")  # noqa: E731
    spec = PartitionSpec("data")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(tree)

  flat, per_leaf = jax.device_get(reduce(True)), jax.device_get(reduce(False))
  for key in tree:
    assert flat[key].dtype == tree[key].dtype, key
    assert flat[key].shape == tree[key].shape, key
    np.testing.assert_array_equal(flat[key], per_leaf[key], err_msg=key)
  # Not vacuous: every device holds the sum of the four rows.
  np.testing.assert_allclose(flat["w"][0], tree["w"].sum(0), rtol=1e-6)


def _eight_rows() -> dict:
  """An LM batch of 8 rows: 4 per device on a data=2 mesh."""
  batch = batches.lm_batch(np.random.default_rng(1))
  return {k: np.concatenate([v, v[::-1]]) for k, v in batch.items()}


def _trainer_steps(config, mesh, monkeypatch, flat: bool, steps: int = 2):
  """(compiled HLO, params, packed metrics per step) of run.jit_steps' train step."""
  if not flat:
    monkeypatch.setattr(data_parallel, "unsupported", lambda *a: "off for the comparison")
  batch = _eight_rows()
  rules = sharding.logical_rules(config)
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  layout = run.state_layout(config, module, tx, batch, mesh, rules)
  state = jax.jit(layout.init_fn, out_shardings=layout.shardings)()
  step, _ = run.jit_steps(config, module, tx, schedule, layout.shardings, mesh, rules)
  compiled = step.lower(state, batch).compile()
  metrics = []
  for _ in range(steps):
    state, m = compiled(state, batch)
    metrics.append(np.asarray(m))
  monkeypatch.undo()
  return compiled.as_text(), jax.device_get(state.params), metrics


def _all_reduce_operands(hlo: str) -> list[int]:
  """Operand count of each all-reduce in the compiled program."""
  return [len(m.split(", %")) for m in re.findall(r" all-reduce\(([^)]*)\)", hlo)]


def _grad_sums_both_ways(config, mesh):
  """steps.accumulated_grad_sums jitted by the partitioner and on the flat path."""
  rules = sharding.logical_rules(config)
  module = models.build(config.model)
  tx, _ = optimizers.build_optimizer(config)
  batch = _eight_rows()
  layout = run.state_layout(config, module, tx, batch, mesh, rules)
  params = jax.jit(layout.init_fn, out_shardings=layout.shardings)().params
  fn = functools.partial(
      steps.accumulated_grad_sums,
      apply_fn=run.make_apply_fn(module, config.model),
      label_smoothing=0.0,
      z_loss=0.0,
      grad_accum_steps=config.train.grad_accum_steps,
  )
  args = (params, batch, jax.random.key(0))
  shardings = (layout.shardings.params, sharding.batch_sharding(mesh), sharding.replicated(mesh))
  outputs = []
  for wrapped in (fn, data_parallel.flat_all_reduce(fn, mesh)):
    jitted = jax.jit(
        sharding.with_rules(wrapped, mesh, rules),
        in_shardings=shardings,
        out_shardings=sharding.replicated(mesh),
    )
    outputs.append(jax.device_get(jitted(*args)))
  return outputs


def _rel(a, b) -> float:
  """max |a - b| / max |b|: the norm-wise relative difference of two arrays."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


@pytest.mark.parametrize("preset", slow_except(["tiny", "llama-tiny"], "tiny"))
def test_the_flat_gradient_sums_match_the_partitioners(preset):
  auto, flat = _grad_sums_both_ways(gpt.get_config(preset), _mesh(data=2))
  same = 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(flat), jax.tree.leaves(auto)):
    assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
    # Each device's partial sums are added as the partitioner adds them, except where the
    # partitioner reduces a leaf's terms separately (the tied embedding's two uses) or
    # restructures a dot: there the float additions come in another order.
    assert _rel(a, b) < 1e-6, (jax.tree_util.keystr(path), _rel(a, b))
    same += np.array_equal(a, b)
  assert same >= len(jax.tree.leaves(flat)) // 2, same  # mostly the very same bits
  assert float(np.abs(flat[1]["token_embed"]["embedding"]).max()) > 0  # a real gradient


def test_the_trainer_step_sums_one_buffer_and_matches_the_partitioners_step(monkeypatch):
  config = gpt.get_config("tiny")
  config.optimizer.learning_rate = 1e-2
  mesh = _mesh(data=2)
  hlo_flat, flat, flat_metrics = _trainer_steps(config, mesh, monkeypatch, flat=True)
  hlo_auto, auto, auto_metrics = _trainer_steps(config, mesh, monkeypatch, flat=False)

  # What the path changes: one all-reduce of a single f32 buffer instead of one per leaf.
  assert _all_reduce_operands(hlo_flat) == [1], _all_reduce_operands(hlo_flat)
  assert sum(_all_reduce_operands(hlo_auto)) > len(jax.tree.leaves(flat)) // 2
  # The gradient sums agree to float rounding (above), and XLA fuses the global norm's
  # reduction differently in the two programs: the updates agree to the last bits.
  for a, b in zip(flat_metrics, auto_metrics):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(flat), jax.tree.leaves(auto)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  assert flat_metrics[1][-1] > 0  # the second step updated the params (lr > 0)


def test_gradient_accumulation_on_the_flat_path_matches_the_partitioner(monkeypatch):
  config = gpt.get_config("tiny")
  config.train.grad_accum_steps = 2
  mesh = _mesh(data=2)
  _, flat, flat_metrics = _trainer_steps(config, mesh, monkeypatch, flat=True, steps=1)
  _, auto, auto_metrics = _trainer_steps(config, mesh, monkeypatch, flat=False, steps=1)
  # The micro-batches' sums are added in another order (per device first): float rounding.
  np.testing.assert_allclose(flat_metrics[0], auto_metrics[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(auto)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _params_sharding(config, mesh):
  rules = sharding.logical_rules(config)
  module = models.build(config.model)
  tx, _ = optimizers.build_optimizer(config)
  batch = batches.lm_batch(np.random.default_rng(0))
  return run.state_layout(config, module, tx, batch, mesh, rules).shardings.params


def test_the_flat_path_applies_only_where_it_computes_the_same_step():
  config = gpt.get_config("tiny")
  two = _mesh(2)
  assert data_parallel.unsupported(two, _params_sharding(config, two), config.model) is None

  one = _mesh(1)
  assert "one device" in data_parallel.unsupported(one, _params_sharding(config, one), config.model)

  fsdp = _mesh(1, fsdp=2)
  reason = data_parallel.unsupported(fsdp, _params_sharding(config, fsdp), config.model)
  assert "sharded" in reason

  tensor = _mesh(2, tensor=2)
  reason = data_parallel.unsupported(tensor, _params_sharding(config, tensor), config.model)
  assert "tensor=2" in reason

  dropout = gpt.get_config("tiny")
  dropout.model.attention_dropout_rate = 0.1
  reason = data_parallel.unsupported(_mesh(2), _params_sharding(dropout, _mesh(2)), dropout.model)
  assert "model.attention_dropout_rate=0.1" in reason

