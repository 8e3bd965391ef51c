"""Whole models train context-parallel: GPT, LLaMA (GQA, RoPE) and T5 (relative bias) take 3
trainer steps on a mesh with data=2, sequence=4 (LLaMA also on fsdp=2, sequence=2, tensor=2)
and give the single-device losses to 1e-5 relative; their compiled step moves keys around the
ring (collective-permutes). KV-cached decoding still works under the sequence rules."""

import jax
import numpy as np
import pytest

from tests.test_sharded_steps import _batch, _family_config, _parts
from tx_jax import sharding
from tx_jax.train import run

STEPS = 3


def _losses(config, mesh=None, rules=None, order=lambda batch: batch):
  """Per-step losses of STEPS trainer steps on the batch in `order`, unsharded when `mesh` is
  None; and the step's compiled text."""
  init_params, init_fn, step = _parts(config)
  batch = order(_batch(config))
  if mesh is None:
    state, jstep = jax.jit(init_fn)(), jax.jit(step)
  else:
    boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    shardings = sharding.state_shardings(jax.eval_shape(init_fn), boxed, mesh, rules)
    state = jax.jit(init_fn, out_shardings=shardings)()
    batch_sh = sharding.batch_sharding(mesh)
    batch = jax.device_put(batch, batch_sh)
    jstep = jax.jit(
        sharding.with_rules(step, mesh, rules),
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, sharding.replicated(mesh)),
    )
  losses = []
  for _ in range(STEPS):
    state, metrics = jstep(state, batch)
    losses.append(float(metrics["loss_sum"] / metrics["weight_sum"]))
  return losses, jstep.lower(state, batch).compile().as_text()


SEQ4 = (2, 1, 4, 1)  # (data, fsdp, sequence, tensor)


@pytest.mark.parametrize(
    "family, mesh_shape, load_balance",
    [
        ("llama", SEQ4, "data"),
        pytest.param("gpt", SEQ4, "data", marks=pytest.mark.slow),
        pytest.param("t5", SEQ4, "data", marks=pytest.mark.slow),
        pytest.param("llama", (1, 2, 2, 2), "data", marks=pytest.mark.slow),  # fsdp and tensor
        pytest.param("gpt", SEQ4, "attention", marks=pytest.mark.slow),
        pytest.param("t5", SEQ4, "none", marks=pytest.mark.slow),
    ],
)
def test_context_parallel_training_equals_single_device(family, mesh_shape, load_balance):
  config = _family_config(family)
  config.model.attention_dropout_rate = 0.0  # context-parallel attention has no dropout
  config.model.context_load_balance = load_balance
  mesh_config = config.copy_and_resolve_references()
  m = mesh_config.mesh
  m.data, m.fsdp, m.sequence, m.tensor = mesh_shape
  sharding.validate(mesh_config, jax.device_count())
  mesh, rules = sharding.make_mesh(m), sharding.logical_rules(mesh_config)
  # The trainer's token order (zig-zag under "data"), for both runs: dropout's masks fall on
  # token slots, so another order is another draw (tests/data/test_context_order.py shows
  # that without dropout the order changes no logit).
  order = run.context_order(mesh_config, mesh, rules)
  ref, _ = _losses(config, order=order)
  got, text = _losses(mesh_config, mesh, rules, order)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  assert len(set(ref)) == STEPS, ref  # the steps really trained
  assert "collective-permute" in text  # the ring ran, not GSPMD's gather


@pytest.mark.slow  # whole-model decoding
def test_kv_cached_decoding_on_a_sequence_mesh_equals_single_device():
  """Decode steps keep the dense path (they gather the cache) under the sequence rules."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  from tests.decode.test_generate import PROMPTS, decoder  # pylint: disable=g-import-not-at-top
  from tx_jax import decode  # pylint: disable=g-import-not-at-top

  module, params, _ = decoder("gpt2-learned")
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=4)
  greedy = decode.Strategy("greedy", max_new_tokens=4)
  want = decode.generate(module, params, prompt, greedy, eos_id=None)
  config = _family_config("gpt")
  config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = 2, 1, 4, 1
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
    params = jax.device_put(params, sharding.replicated(mesh))
    got = decode.generate(module, params, prompt, greedy, eos_id=None)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_attention_dropout_on_a_sequence_mesh_is_refused_before_any_work():
  from tx_jax import validation  # pylint: disable=g-import-not-at-top

  config = _family_config("gpt")  # attention dropout 0.1
  config.mesh.data, config.mesh.sequence = 2, 4
  with pytest.raises(ValueError, match=r"config.mesh.sequence=4 .*attention_dropout_rate=0.1"):
    validation.context_parallel_supported(config)
  config.model.attention_dropout_rate = 0.0
  validation.context_parallel_supported(config)


def test_the_trainer_orders_causal_batches_only_on_a_sequence_mesh():
  """run.context_order: zig-zag rows with their natural indices on a sequence mesh with
  load balance "data"; the batch untouched otherwise."""
  config = _family_config("gpt")
  batch = _batch(config)
  for shape, balance, reordered in [(SEQ4, "data", True), (SEQ4, "attention", False),
                                    ((8, 1, 1, 1), "data", False)]:
    config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = shape
    config.model.context_load_balance = balance
    mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
    got = run.context_order(config, mesh, rules)(batch)
    assert ("token_index" in got) == reordered
    if reordered:
      order = got["token_index"][0]
      assert sorted(order) == list(range(len(order))) and list(order) != sorted(order)
      np.testing.assert_array_equal(got["inputs"], batch["inputs"][:, order])
