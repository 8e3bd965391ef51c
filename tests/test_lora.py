"""LoRA in the models and the frozen base: step-0 identity, the adapter's formula, and a train
step that moves only the adapters and keeps optimizer state for nothing else."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import bert, gpt, t5
from tests.train import batches, runs
from tx_jax import models
from tx_jax.layers.linear import Linear
from tx_jax.layers.lora import LoraSpec
from tx_jax.train import loop, optimizers, state as state_lib, steps


def _tiny(name: str, **model):
  config = {
      "gpt": lambda: gpt.get_config("tiny"),
      "llama": lambda: gpt.get_config("llama-tiny"),
      "bert": lambda: bert.get_config("tiny"),
      "t5": lambda: t5.get_config("tiny"),
  }[name]()
  config.model.num_layers = 1
  if config.model.family == "encdec":
    config.model.num_decoder_layers = 1
  config.model.update(model)
  return config


def _batch(config):
  rng = np.random.default_rng(0)
  family = config.model.family
  if family == "encdec":
    return batches.seq2seq_batch(rng)
  return batches.mlm_batch(rng) if family == "encoder" else batches.lm_batch(rng)


def _flat(tree):
  return traverse_util.flatten_dict(nn.unbox(jax.device_get(tree)), sep="/")


def _logits(config, params, batch):
  args, kwargs = models.model_inputs(config.model, batch)
  return models.build(config.model).apply({"params": params}, *args, **kwargs)


def _with_lora(config, targets, rank=4, **lora):
  config = config.copy_and_resolve_references()
  config.model.lora.update(rank=rank, targets=targets, **lora)
  return config


def _slow_after(cases, fast: int):
  """Tuple cases, the first `fast` in the fast tier and the rest marked slow (tests/tiers.py)."""
  return list(cases[:fast]) + [pytest.param(*c, marks=pytest.mark.slow) for c in cases[fast:]]


CASES = [
    ("gpt", {"fused_qkv": False}, ("query", "value", "output", "mlp_up", "mlp_down")),
    ("gpt", {"fused_qkv": True, "scan_layers": True}, ("qkv",)),
    ("llama", {"attention_backend": "blockwise"}, ("query", "key", "mlp_gate", "lm_head")),
    ("bert", {}, ("query", "value")),
    ("t5", {"scan_layers": True}, (r"cross_attention/(query|value)", "mlp_down", "lm_head")),
]


# The fast tier keeps the GPT cases (scan off and on); every family runs in the whole suite.
@pytest.mark.parametrize("name,model,targets", _slow_after(CASES, 2), ids=str)
def test_step0_is_the_base_model(name, model, targets):
  """B starts at zero, so the adapted model's logits are the base model's, bit for bit."""
  base = _tiny(name, **model)
  if name == "t5":
    base.model.tie_embeddings = False  # an untied lm_head to adapt
  adapted = _with_lora(base, targets)
  batch = _batch(base)
  args, kwargs = models.model_inputs(adapted.model, batch)
  params = models.build(adapted.model).init(jax.random.key(1), *args, **kwargs)["params"]
  flat = _flat(params)
  adapters = [k for k in flat if k.endswith(("lora_a", "lora_b"))]
  assert adapters, "no projection was adapted"
  assert all(not np.any(flat[k]) for k in adapters if k.endswith("lora_b"))
  assert all(np.any(flat[k]) for k in adapters if k.endswith("lora_a"))
  base_params = traverse_util.unflatten_dict(
      {k: v for k, v in flat.items() if k not in adapters}, sep="/"
  )
  want = _logits(base, base_params, batch)
  got = _logits(adapted, nn.unbox(params), batch)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_adapter_is_x_w_plus_scaled_x_a_b():
  """A LoRA Linear against numpy: x·W + b + (alpha/r)·x·A·B, with 2 contracted dims."""
  spec = LoraSpec(rank=3, alpha=6.0, targets=("output",))
  layer = Linear(5, ("heads", "head_dim", "embed"), in_dims=2, use_bias=True, lora=spec, name="out")
  x = np.random.default_rng(0).normal(size=(2, 7, 4, 8)).astype(np.float32)
  params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
  assert params["lora_a"].shape == (4, 8, 3) and params["lora_b"].shape == (3, 5)
  rng = np.random.default_rng(1)
  params = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
  got = np.asarray(layer.apply({"params": params}, x))
  xf = x.reshape(2, 7, 32).astype(np.float64)
  a, b = params["lora_a"].reshape(32, 3), params["lora_b"]
  want = xf @ params["kernel"].reshape(32, 5) + params["bias"] + 2.0 * (xf @ a) @ b
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_only_in_training():
  spec = LoraSpec(rank=2, dropout=0.5, targets=("mlp_up",))
  layer = Linear(4, ("embed", "mlp"), lora=spec, name="wi")
  x = np.ones((3, 8), np.float32)
  params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
  params["lora_b"] = np.ones_like(params["lora_b"])
  plain = layer.apply({"params": params}, x)
  trained = layer.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(plain, layer.apply({"params": params}, x))
  assert not np.allclose(plain, trained)
  no_adapter = dict(params, lora_b=np.zeros_like(params["lora_b"]))
  np.testing.assert_array_equal(  # dropout reaches the adapter's input only
      layer.apply({"params": no_adapter}, x, train=True, rngs={"dropout": jax.random.key(2)}),
      layer.apply({"params": no_adapter}, x),
  )


def _train_one_step(config):
  batch = _batch(config)
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  args, kwargs = models.model_inputs(config.model, batch)
  init = state_lib.make_init_fn(
      lambda r: module.init({"params": r}, *args, **kwargs, train=False)["params"], tx, 0
  )
  state0 = jax.jit(init)()
  step = functools.partial(
      steps.train_step,
      apply_fn=loop.make_apply_fn(module, config.model),
      tx=tx,
      schedule=schedule,
  )
  state1, _ = jax.jit(step)(state0, batch)
  state2, _ = jax.jit(step)(state1, batch)
  return jax.device_get(state0), jax.device_get(state2)


@pytest.mark.parametrize(
    "name,scan", _slow_after([("gpt", True), ("gpt", False), ("t5", False)], 1)
)
def test_only_adapters_and_also_train_change(name, scan):
  """AdamW (gpt) and Adafactor (t5's preset), layers unrolled and scanned."""
  targets = ("qkv", "mlp_down") if name == "gpt" else ("query", "value", "mlp_down")
  config = _with_lora(_tiny(name, scan_layers=scan), targets, also_train=("final_norm",))
  config.optimizer.weight_decay = 0.1  # decay must not reach the frozen base either
  config.schedule.warmup_steps = 0
  state0, state2 = _train_one_step(config)
  before, after = _flat(state0.params), _flat(state2.params)
  trained = {k for k in before if k.endswith(("lora_a", "lora_b")) or "final_norm" in k}
  assert trained and len(trained) < len(before)
  for key in before:
    if key in trained:
      assert np.any(before[key] != after[key]), f"{key} did not train"
    else:
      assert before[key].tobytes() == after[key].tobytes(), f"frozen {key} changed"

  # Optimizer statistics exist for the trained params only: Adam's 2 floats each, Adafactor's
  # factored rows and columns (at most 2 each, since they are smaller), plus step counts.
  trained_size = sum(before[k].size for k in trained)
  moments = [x for x in jax.tree.leaves(state2.opt_state) if np.ndim(x) > 0]
  if config.optimizer.name == "adamw":
    assert sum(x.size for x in moments) == 2 * trained_size
  else:
    assert 0 < sum(x.size for x in moments) <= 2 * trained_size


def test_optimizer_state_of_full_finetuning_is_larger():
  """The same model without LoRA keeps moments for every param: the saving is real."""
  lora = _with_lora(_tiny("gpt"), ("query", "value"))
  full = _tiny("gpt")
  sizes = []
  for config in (lora, full):
    params = models.abstract_params(config.model)
    tx, _ = optimizers.build_optimizer(config)
    opt = jax.eval_shape(tx.init, params)
    sizes.append(sum(x.size for x in jax.tree.leaves(opt) if x.ndim))
  n_full = sum(x.size for x in jax.tree.leaves(models.abstract_params(full.model)))
  assert sizes[1] == 2 * n_full
  assert sizes[0] < sizes[1] / 10


@pytest.mark.slow
def test_lora_run_resumes_bitwise(tmp_path, capsys):
  """Trainer runs: 3 steps, then resumed to 6, equal 6 uninterrupted steps bit for bit."""
  from tests.train import runs  # pylint: disable=g-import-not-at-top

  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  config = gpt.get_config("tiny")
  flags = runs.tiny_gpt_flags(corpus, tmp_path, steps=6, **{"checkpoint.every": 3})
  for flag in flags[2:]:
    key, value = flag[len("--config.") :].split("=", 1)
    section, field = key.split(".")
    config[section][field] = type(config[section][field])(value) if value != "False" else False
  config.model.lora.update(rank=4, dropout=0.1, targets=("qkv", "mlp_down"))
  config.mesh.cpu_devices = 0
  config.schedule.warmup_steps, config.schedule.decay_steps = 2, 6  # one schedule for all runs

  def train(workdir, steps):
    c = config.copy_and_resolve_references()
    c.train.steps = steps
    loop.train_and_evaluate(c, workdir)

  train(tmp_path / "full", 6)
  train(tmp_path / "resumed", 3)
  capsys.readouterr()
  train(tmp_path / "resumed", 6)
  assert "resumed from step 3" in capsys.readouterr().out  # not a second run from scratch
  full, resumed = (jax.tree.leaves(runs.saved_state(tmp_path / run, 6)) for run in ("full", "resumed"))
  assert len(full) == len(resumed) and len(full) > 10
  assert all(a.tobytes() == b.tobytes() for a, b in zip(full, resumed))
  # The steps hold what trains; the whole params, frozen base included, match too.
  from tx_jax import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  saved = _flat(runs.saved_state(tmp_path / "full", 6)["params"])
  assert saved and all(k.endswith(("lora_a", "lora_b")) for k in saved)
  full, resumed = (
      jax.tree.leaves(workdir_lib.restore_params(tmp_path / run, config.model, 6)[0])
      for run in ("full", "resumed")
  )
  assert len(full) == len(resumed) > len(saved)
  assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(full, resumed))


def test_to_peft_refuses_a_run_that_trained_base_params(tmp_path):
  from tx_jax import hf  # pylint: disable=g-import-not-at-top
  from tx_jax.interop import peft  # pylint: disable=g-import-not-at-top

  config = _with_lora(_tiny("gpt"), ("qkv",), also_train=("final_norm",))
  mc = models.ModelConfig.from_config(config.model)
  with pytest.raises(hf.ConversionError, match="also_train"):
    peft.to_peft(mc, hf.architecture_for(mc), {}, tmp_path / "adapter")
  assert not (tmp_path / "adapter").exists()
