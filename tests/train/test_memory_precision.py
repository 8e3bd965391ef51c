"""Remat, scan over layers and bf16 compute through the real train step (tiny GPT)."""

import functools
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from configs import gpt
from tests.train.batches import lm_batch
from tx_jax import models
from tx_jax.train import loop, optimizers, state as state_lib, steps

pytestmark = pytest.mark.slow


def _one_step(**model):
  config = gpt.get_config("tiny")
  config.model.update(
      dict(num_layers=2, d_model=32, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64), **model
  )
  batch = lm_batch(np.random.default_rng(1))
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  args, kwargs = models.model_inputs(config.model, batch)
  state = jax.jit(
      state_lib.make_init_fn(
          lambda r: module.init({"params": r}, *args, **kwargs, train=False)["params"], tx, 0
      )
  )()
  step = jax.jit(
      functools.partial(
          steps.train_step,
          tx=tx,
          schedule=schedule,
          apply_fn=loop.make_apply_fn(module, config.model),
      )
  )
  new, metrics = step(state, batch)
  return state, new, jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference():
  return _one_step()


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_nothing_but_memory(reference, policy):
  _, ref_new, ref_m = reference
  _, new, m = _one_step(remat_policy=policy)
  assert float(m["loss_sum"]) == pytest.approx(float(ref_m["loss_sum"]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(ref_new.params), jax.tree.leaves(new.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _stack_layers(tree):
  """Unrolled params (layer_0, layer_1, ...) in nn.scan's layout: layers/layer, axis 0 = layer."""
  if not isinstance(tree, dict):
    return tree
  layers = sorted((k for k in tree if re.fullmatch(r"layer_\d+", k)), key=lambda k: int(k[6:]))
  out = {k: _stack_layers(v) for k, v in tree.items() if k not in layers}
  if layers:
    out["layers"] = {"layer": jax.tree.map(lambda *xs: np.stack(xs), *[tree[k] for k in layers])}
  return out


def test_scan_over_layers_stacks_params_and_trains(reference):
  ref_state, _, ref_m = reference
  state, _, m = _one_step(scan_layers=True)
  unrolled = nn.meta.unbox(jax.device_get(ref_state.params))
  scanned = nn.meta.unbox(jax.device_get(state.params))
  # The scanned tree is the unrolled one with its 2 layers stacked on a leading axis.
  shapes = lambda t: jax.tree.map(lambda x: x.shape, t)  # noqa: E731
  assert shapes(scanned) == shapes(_stack_layers(unrolled))
  assert shapes(scanned) != shapes(unrolled)
  # Same function: the scanned model on the unrolled weights, stacked, gives the same logits.
  config = gpt.get_config("tiny")
  small = dict(num_layers=2, d_model=32, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64)
  batch = lm_batch(np.random.default_rng(1))
  logits = {}
  for scan, params in ((False, unrolled), (True, _stack_layers(unrolled))):
    config.model.update(dict(small, scan_layers=scan))
    module = models.build(config.model)
    args, kwargs = models.model_inputs(config.model, batch)
    logits[scan] = np.asarray(module.apply({"params": params}, *args, **kwargs, train=False))
  np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)
  # And one train step on it starts from the same loss scale as the unrolled model's.
  assert abs(float(m["loss_sum"]) - float(ref_m["loss_sum"])) / float(ref_m["loss_sum"]) < 0.05


def test_bf16_compute_keeps_f32_params_and_is_close(reference):
  _, _, ref_m = reference
  state, new, m = _one_step(dtype="bfloat16")
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(new.params))
  assert float(m["loss_sum"]) == pytest.approx(float(ref_m["loss_sum"]), rel=2e-2)
