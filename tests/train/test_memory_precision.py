"""Remat, scan over layers and bf16 compute through the real train step (tiny GPT)."""

import functools

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


def test_scan_over_layers_stacks_params_and_trains(reference):
  _, _, ref_m = reference
  state, _, m = _one_step(scan_layers=True)
  # Same initial loss scale: ~log(vocab) for a fresh model either way.
  assert abs(float(m["loss_sum"]) - float(ref_m["loss_sum"])) / float(ref_m["loss_sum"]) < 0.05
  shapes = [x.shape for x in jax.tree.leaves(state.params)]
  assert any(s and s[0] == 2 for s in shapes)  # the layer axis


def test_bf16_compute_keeps_f32_params_and_is_close(reference):
  _, _, ref_m = reference
  state, new, m = _one_step(dtype="bfloat16")
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(new.params))
  assert float(m["loss_sum"]) == pytest.approx(float(ref_m["loss_sum"]), rel=2e-2)
