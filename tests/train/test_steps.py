"""Train/eval steps on a stand-in model: accumulation, non-finite guard, decay masks, bf16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import common, train_defaults
from tests.train import standin
from tx_jax.train import optimizers, state as state_lib, steps


def _config(**optimizer):
  import ml_collections

  c = ml_collections.ConfigDict(
      {
          "train": train_defaults.train_config(),
          "optimizer": train_defaults.optimizer_config(),
          "schedule": train_defaults.schedule_config(),
          "loss": train_defaults.loss_config(),
          "model": {"d_model": 16, "lora": common.lora_config()},
      }
  )
  c.schedule.name, c.schedule.warmup_steps = "constant", 0
  c.train.steps = 100
  c.optimizer.update(optimizer)
  return c


def _state(module, batch, tx, seed=0):
  init = state_lib.make_init_fn(
      lambda r: module.init(r, jnp.asarray(batch["inputs"]))["params"], tx, seed
  )
  return jax.jit(init)()


@pytest.fixture(scope="module")
def setup():
  module = standin.TinyLM()
  batch = standin.lm_batch(batch=8)
  return module, batch


def test_accumulated_micro_batches_equal_one_big_batch(setup):
  module, batch = setup
  tx, schedule = optimizers.build_optimizer(_config(learning_rate=1e-2, grad_clip_norm=0.0))
  step = functools.partial(
      steps.train_step, apply_fn=standin.apply_fn_for(module), tx=tx, schedule=schedule
  )
  state = _state(module, batch, tx)
  big, m_big = jax.jit(step)(state, batch)
  small, m_small = jax.jit(functools.partial(step, grad_accum_steps=4))(state, batch)
  for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(small.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  np.testing.assert_allclose(float(m_big["grad_norm"]), float(m_small["grad_norm"]), rtol=1e-6)
  assert float(m_big["loss_sum"]) == pytest.approx(float(m_small["loss_sum"]), rel=1e-6)
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    jax.jit(functools.partial(step, grad_accum_steps=3))(state, batch)


def test_nonfinite_batch_is_skipped_and_counted(setup):
  module, batch = setup
  tx, schedule = optimizers.build_optimizer(_config())
  step = jax.jit(
      functools.partial(
          steps.train_step, apply_fn=standin.apply_fn_for(module), tx=tx, schedule=schedule
      )
  )
  state = _state(module, batch, tx)
  # A NaN weight makes the loss NaN, as a corrupt batch would.
  bad = dict(
      batch, weights=np.where(np.arange(6) == 0, np.nan, batch["weights"]).astype(np.float32)
  )
  new, metrics = step(state, bad)
  assert int(metrics["nonfinite"]) == 1 and int(new.skipped) == 1 and int(new.step) == 1
  for a, b in zip(
      jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((new.params, new.opt_state))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  newer, metrics = step(new, batch)
  assert int(metrics["nonfinite"]) == 0 and int(newer.skipped) == 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newer.params))


def test_weight_decay_mask_spares_norms_biases_embeddings(setup):
  module, batch = setup
  params = standin.init_params(module, batch)
  mask = optimizers.decay_mask(params, tuple(train_defaults.optimizer_config().no_decay))
  flat = {optimizers.path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
  assert flat == {
      "embed/embedding": False,
      "norm/scale": False,
      "norm/bias": False,
      "hidden/kernel": True,
      "hidden/bias": False,
      "out/kernel": True,
      "out/bias": False,
  }
  # With zero gradients AdamW changes exactly the decayed leaves, by lr * wd * p.
  for name in ("adamw", "adafactor"):
    tx, _ = optimizers.build_optimizer(
        _config(name=name, learning_rate=0.1, weight_decay=0.5, grad_clip_norm=0.0)
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates = jax.jit(lambda p, z: tx.update(z, tx.init(p), p)[0])(params, zeros)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
      decayed = flat[optimizers.path_str(path)]
      assert bool(jnp.any(u != 0)) == decayed, (name, optimizers.path_str(path))
      if name == "adamw" and decayed:
        p = params
        for k in path:
          p = p[k.key]
        np.testing.assert_allclose(np.asarray(u), -0.1 * 0.5 * np.asarray(p), rtol=1e-6)


def test_clipping_bounds_the_update_norm(setup):
  module, batch = setup
  params = standin.init_params(module, batch)
  tx, _ = optimizers.build_optimizer(
      _config(name="adamw", learning_rate=1.0, grad_clip_norm=0.5, b1=0.0, b2=0.0, eps=0.0)
  )
  big = jax.tree.map(lambda p: jnp.full_like(p, 10.0), params)
  clipped = optax.clip_by_global_norm(0.5).update(big, optax.EmptyState())[0]
  assert float(optax.global_norm(clipped)) == pytest.approx(0.5, rel=1e-5)
  with pytest.raises(ValueError, match="config.optimizer.name='sgd'"):
    optimizers.build_optimizer(_config(name="sgd"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stand_in_overfits_one_batch(setup, dtype):
  module, batch = setup
  module = standin.TinyLM(dtype=dtype, param_dtype=jnp.float32, width=32)
  tx, schedule = optimizers.build_optimizer(_config(learning_rate=3e-2))
  raw_step = functools.partial(
      steps.train_step, apply_fn=standin.apply_fn_for(module), tx=tx, schedule=schedule
  )
  step = jax.jit(raw_step, donate_argnums=0)
  # Targets must be a function of the input token for a per-token model to fit them.
  batch = dict(batch, targets=(batch["inputs"] * 3 + 1) % 11)
  state = _state(module, batch, tx)
  # The step really computes in `dtype` (bf16 matmuls under bf16 compute, none under f32)...
  dots = [
      e for e in jax.make_jaxpr(raw_step)(state, batch).eqns if e.primitive.name == "dot_general"
  ]
  assert dots and all(
      (e.invars[0].aval.dtype == jnp.bfloat16) == (dtype == jnp.bfloat16) for e in dots[:2]
  )
  for _ in range(150):
    state, metrics = step(state, batch)
  loss = float(metrics["loss_sum"] / metrics["weight_sum"])
  assert loss < 0.05, loss
  # ...while the params and Adam's moments stay float32 after 150 updates.
  def floats(tree):
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}

  assert floats(state.params) == floats(state.opt_state) == {jnp.dtype(jnp.float32)}
  # ...holding float32 values: an update rounded through bf16 would leave only bf16 values.
  kernel = np.asarray(state.params["hidden"]["kernel"])
  assert np.mean(kernel != kernel.astype(jnp.bfloat16).astype(np.float32)) > 0.5
  ev = steps.eval_step(state.params, batch, apply_fn=standin.apply_fn_for(module))
  assert float(ev["correct_sum"]) == float(ev["weight_sum"])
