"""tx_jax.sharding on 8 fake CPU devices, with a tiny hand-made logically-partitioned model."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from configs import sharding_rules
from tests.models.variants import VARIANTS
from tx_jax import models, sharding
from tx_jax.layers import axes
from tx_jax.layers.lora import LoraSpec
from tests.tiers import slow_except

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, BATCH, LEN = 32, 16, 4, 4, 32, 8, 4
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]


class TinyLM(nn.Module):
  """One attention + MLP block with the tx_jax logical axis names, Megatron-shaped kernels."""

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.2)
    part = nn.with_logical_partitioning
    emb = self.param("embedding", part(init, (axes.VOCAB, axes.EMBED)), (VOCAB, EMBED))
    x = jnp.take(emb, tokens, axis=0)
    x = axes.constrain(x, "BTD")
    scale = self.param("scale", part(nn.initializers.ones, (axes.EMBED,)), (EMBED,))
    h = x * scale
    qkv_shape, out_shape = (EMBED, HEADS, HEAD_DIM), (HEADS, HEAD_DIM, EMBED)
    q_axes = (axes.EMBED, axes.HEADS, axes.HEAD_DIM)
    kv_axes = (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM)
    q = self.param("query", part(init, q_axes), qkv_shape)
    k = self.param("key", part(init, kv_axes), qkv_shape)
    v = self.param("value", part(init, kv_axes), qkv_shape)
    o = self.param("out", part(init, (axes.HEADS, axes.HEAD_DIM, axes.EMBED)), out_shape)
    q_BTNH = jnp.einsum("btd,dnh->btnh", h, q)
    q_BTNH = axes.constrain(q_BTNH, "BTNH")
    k_BSNH = jnp.einsum("btd,dnh->btnh", h, k)
    v_BSNH = jnp.einsum("btd,dnh->btnh", h, v)
    logits = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) / math.sqrt(HEAD_DIM)
    att = jax.nn.softmax(logits, axis=-1)
    x = x + jnp.einsum("bnts,bsnh,nhd->btd", att, v_BSNH, o)
    x = axes.constrain(x, "BTD")
    up = self.param("up", part(init, (axes.EMBED, axes.MLP)), (EMBED, MLP))
    down = self.param("down", part(init, (axes.MLP, axes.EMBED)), (MLP, EMBED))
    bias = self.param("up_bias", part(nn.initializers.zeros, (axes.MLP,)), (MLP,))
    hid = nn.gelu(x @ up + bias)
    hid = axes.constrain(hid, "BTF")
    x = x + hid @ down
    head = self.param("head", part(init, (axes.EMBED, axes.VOCAB)), (EMBED, VOCAB))
    logits_BTV = x @ head
    return axes.constrain(logits_BTV, "BTV")


def _config(data=-1, fsdp=1, tensor=1, sequence=1, batch=BATCH, accum=1, **model):
  config = ml_collections.ConfigDict()
  config.mesh = sharding_rules.mesh_config()
  config.mesh.update(data=data, fsdp=fsdp, tensor=tensor, sequence=sequence)
  config.sharding = sharding_rules.sharding_config()
  config.model = ml_collections.ConfigDict(
      dict(num_heads=HEADS, num_kv_heads=HEADS, mlp_dim=MLP, vocab_size=VOCAB, d_model=EMBED)
  )
  config.model.update(model)
  config.data = ml_collections.ConfigDict(
      dict(
          global_batch_size=batch,
          eval_global_batch_size=BATCH,
          task="lm",
          seq_len=LEN,
          source_len=LEN,
          target_len=LEN,
      )
  )
  config.train = ml_collections.ConfigDict(dict(grad_accum_steps=accum))
  return config


@pytest.fixture(scope="module")
def tiny():
  module = TinyLM()
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (BATCH, LEN)), jnp.int32)
  boxed = jax.eval_shape(module.init, jax.random.key(0), tokens)["params"]
  return module, tokens, boxed


# ----------------------------------------------------------------------------- mesh


def test_mesh_shape_fills_the_minus_one_axis():
  cfg = sharding_rules.mesh_config()
  assert sharding.mesh_shape(cfg, 8) == dict(data=8, fsdp=1, sequence=1, tensor=1)
  cfg.update(data=2, fsdp=-1, tensor=2)
  assert sharding.mesh_shape(cfg, 8) == dict(data=2, fsdp=2, sequence=1, tensor=2)


@pytest.mark.parametrize(
    "sizes, pattern",
    [
        (dict(data=2, fsdp=2, tensor=3), r"multiply to 12 but there are 8 devices"),
        (dict(data=-1, fsdp=3), r"config.mesh.data=-1 cannot fill 8 devices.*3"),
        (dict(data=-1, fsdp=-1), r"only one axis may be -1"),
        (dict(tensor=0), r"config.mesh.tensor=0"),
    ],
)
def test_mesh_shape_errors_name_the_numbers(sizes, pattern):
  cfg = sharding_rules.mesh_config()
  cfg.update(**sizes)
  with pytest.raises(ValueError, match=pattern):
    sharding.mesh_shape(cfg, 8)


@pytest.mark.parametrize("shape", MESHES)
def test_make_mesh_uses_every_device_once(shape):
  mesh = sharding.make_mesh(_config(*shape).mesh)
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == dict(data=shape[0], fsdp=shape[1], sequence=1, tensor=shape[2])
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_on_given_devices():
  mesh = sharding.make_mesh(_config(data=-1).mesh, devices=jax.devices()[:1])
  assert mesh.size == 1 and dict(mesh.shape)["data"] == 1


# ----------------------------------------------------------------------------- rules


def test_logical_rules_normalise_json_lists_and_reject_unknown_axes():
  config = _config()
  config.sharding.rules = [["act_batch", ["data", "fsdp"]], ["vocab", "tensor"], ["embed", None]]
  assert sharding.logical_rules(config) == (
      ("act_batch", ("data", "fsdp")),
      ("vocab", "tensor"),
      ("embed", None),
  )
  config.sharding.rules = [("mlp", "model")]
  with pytest.raises(ValueError, match=r"rules\[0\].*unknown mesh axis 'model'"):
    sharding.logical_rules(config)


def _names_the_models_use(monkeypatch) -> set[str]:
  """Logical names in the boxed abstract params and activation constraints of every family."""
  used = set()
  constrain = nn.with_logical_constraint

  def recording(x, names, *args, **kwargs):
    used.update(name for name in names if name is not None)
    return constrain(x, names, *args, **kwargs)

  monkeypatch.setattr(nn, "with_logical_constraint", recording)
  # Learned positions (gpt2, bert), GQA + RoPE (llama), type embeddings (bert), relative
  # buckets and cross-attention (t5); scanned, so the stacked "layers" axis appears too; LoRA
  # adapters on every projection of t5, so their rank axis too.
  every = LoraSpec(rank=1, targets=(".",))
  for name in ("gpt2", "llama", "bert", "t5"):
    lora = every if name == "t5" else LoraSpec()
    config = dataclasses.replace(VARIANTS[name], scan_layers=True, lora=lora)
    boxed = models.abstract_params(config, boxed=True)
    boxes = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert boxes and all(isinstance(box, nn.Partitioned) for box in boxes), name
    used.update(axis for box in boxes for axis in box.names if axis is not None)
  return used


def test_default_rules_cover_every_logical_axis_name(monkeypatch):
  rule_names = [name for name, _ in sharding.logical_rules(_config())]
  assert len(rule_names) == len(set(rule_names))
  used = _names_the_models_use(monkeypatch)
  assert set(rule_names) == used
  assert used == set(axes.PARAM_AXES) | set(axes.ACTIVATION_AXES.values())


# ----------------------------------------------------------------------------- param shardings

# Megatron + ZeRO-3 expectations written out by hand: column-parallel q/k/v/up, row-parallel
# out/down, vocab-parallel embedding and head, every embed dim on fsdp.
EXPECTED_SPECS = {
    "embedding": P("tensor", "fsdp"),
    "scale": P("fsdp"),
    "query": P("fsdp", "tensor", None),
    "key": P("fsdp", "tensor", None),
    "value": P("fsdp", "tensor", None),
    "out": P("tensor", None, "fsdp"),
    "up": P("fsdp", "tensor"),
    "down": P("tensor", "fsdp"),
    "up_bias": P("tensor"),
    "head": P("fsdp", "tensor"),
}


def _norm(spec):
  return tuple(spec) + (None,) * (3 - len(spec))


@pytest.mark.parametrize("shape", MESHES)
def test_params_are_initialised_sharded_as_the_rules_say(tiny, shape):
  module, tokens, boxed = tiny
  config = _config(*shape)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  shardings = sharding.param_shardings(boxed, mesh, rules)
  for name, spec in EXPECTED_SPECS.items():
    assert _norm(shardings[name].spec) == _norm(spec), name
  init = jax.jit(lambda k: nn.meta.unbox(module.init(k, tokens)["params"]), out_shardings=shardings)
  params = init(jax.random.key(0))
  sizes = dict(mesh.shape)
  for name, spec in EXPECTED_SPECS.items():
    array = params[name]
    expected = tuple(
        dim // (sizes[axis] if axis else 1) for dim, axis in zip(array.shape, _norm(spec))
    )
    assert all(s.data.shape == expected for s in array.addressable_shards), (name, expected)
  # The sharded init holds the same numbers as the same init jitted onto one device.
  plain = jax.jit(lambda k: nn.meta.unbox(module.init(k, tokens)["params"]))(jax.random.key(0))
  for name in EXPECTED_SPECS:
    np.testing.assert_array_equal(np.asarray(params[name]), np.asarray(plain[name]))


def test_fsdp_shards_params_and_optimizer_state_over_the_fsdp_axis(tiny):
  _, _, boxed = tiny
  config = _config(data=1, fsdp=8, tensor=1)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  p_sh = sharding.param_shardings(boxed, mesh, rules)
  total = sharding.total_bytes(boxed)
  # Every tiny-model param has an embed dim or is the [mlp] bias (replicated on fsdp).
  bias_bytes = MLP * 4
  assert sharding.per_device_bytes(boxed, p_sh) == (total - bias_bytes) // 8 + bias_bytes
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, nn.meta.unbox(boxed))
  o_sh = sharding.state_shardings(opt_state, boxed, mesh, rules)
  o_total = sharding.total_bytes(opt_state)
  assert sharding.per_device_bytes(opt_state, o_sh) <= 1.1 * o_total / 8 + 2 * bias_bytes + 64


def test_state_shardings_follow_params_for_adam_and_factored_adafactor(tiny):
  _, _, boxed = tiny
  config = _config(2, 2, 2)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  params = nn.meta.unbox(boxed)
  state = {
      "params": params,
      "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params),
      "step": jax.ShapeDtypeStruct((), jnp.int32),
  }
  sh = sharding.state_shardings(state, boxed, mesh, rules)
  mu = sh["opt_state"][0].mu
  for name, spec in EXPECTED_SPECS.items():
    assert _norm(sh["params"][name].spec) == _norm(spec)
    assert _norm(mu[name].spec) == _norm(spec)
  assert sh["step"].spec == P() and sh["opt_state"][0].count.spec == P()
  factored = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=8).init, params)
  fsh = sharding.state_shardings(factored, boxed, mesh, rules)
  for path, leaf_sh in jax.tree_util.tree_flatten_with_path(fsh)[0]:
    keys = [getattr(e, "key", getattr(e, "name", None)) for e in path]
    if "up" in keys and "v_row" in keys:  # [embed, mlp] without mlp: the embed dim keeps fsdp
      assert _norm(leaf_sh.spec)[:1] == ("fsdp",)
    if "up" in keys and "v_col" in keys:  # [embed, mlp] without embed: mlp keeps tensor
      assert _norm(leaf_sh.spec)[:1] == ("tensor",)
  leaves = jax.tree_util.tree_leaves(factored)
  assert len(leaves) == len(jax.tree_util.tree_leaves(fsh))


def test_indivisible_param_dim_is_an_error_naming_the_param(tiny):
  _, _, boxed = tiny
  config = _config(data=1, fsdp=1, tensor=8)  # heads=4 cannot split 8 ways
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  with pytest.raises(ValueError, match=r"param key: dim 1 \('kv_heads'\) of size 4 .* tensor = 8"):
    sharding.param_shardings(boxed, mesh, rules)


def test_batch_sharding_splits_rows_over_data_and_fsdp():
  mesh = sharding.make_mesh(_config(2, 2, 2).mesh)
  x = jax.device_put(np.arange(BATCH * LEN).reshape(BATCH, LEN), sharding.batch_sharding(mesh))
  assert {s.data.shape for s in x.addressable_shards} == {(BATCH // 4, LEN)}


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(data=2, fsdp=2, tensor=4), r"multiply to 16 but there are 8 devices"),
        (
            dict(data=1, tensor=8),
            r"config.model.num_heads=4 is not divisible by config.mesh.tensor=8 = 8",
        ),
        (
            dict(data=2, tensor=4, num_heads=8, num_kv_heads=2),
            r"config.model.num_kv_heads=2 is not divisible by config.mesh.tensor=4",
        ),
        (dict(data=4, tensor=2, mlp_dim=33), r"config.model.mlp_dim=33 .* config.mesh.tensor=2"),
        (
            dict(data=4, tensor=2, vocab_size=31),
            r"config.model.vocab_size=31 .* config.mesh.tensor=2",
        ),
        (
            dict(data=2, fsdp=4, batch=12),
            r"config.data.global_batch_size=12 .* config.mesh.data=2 x config.mesh.fsdp=4 = 8",
        ),
        (dict(data=8, batch=16, accum=4), r"grad_accum_steps=4 .* multiple of 32"),
        (dict(data=1, sequence=8), r"config.data.seq_len=4 .* config.mesh.sequence=8 = 8"),
    ],
)
def test_validate_fails_early_naming_fields_and_numbers(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    sharding.validate(_config(**kwargs), num_devices=8)


def test_validate_accepts_the_test_meshes_and_rules_that_replicate_kv_heads():
  for shape in MESHES:
    sharding.validate(_config(*shape), num_devices=8)
  config = _config(data=2, tensor=4, num_heads=8, num_kv_heads=1)
  config.sharding.rules = [
      r if r[0] != "kv_heads" else ("kv_heads", None) for r in config.sharding.rules
  ]
  sharding.validate(config, num_devices=8)


def test_validate_multiprocess_needs_batch_axes_split_over_processes():
  with pytest.raises(ValueError, match=r"do not split over 2 processes"):
    sharding.validate(
        _config(data=1, tensor=8, num_heads=8, vocab_size=64, mlp_dim=64, num_kv_heads=8),
        num_devices=8,
        num_processes=2,
    )


# ----------------------------------------------------------------------------- steps


def _loss(params, module, tokens):
  logits = module.apply({"params": params}, tokens).astype(jnp.float32)
  targets = jnp.roll(tokens, -1, axis=1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.fixture(scope="module")
def reference_step(tiny):
  """The single-device step: loss and Adam-updated params, no mesh at all."""
  module, tokens, _ = tiny
  params = nn.meta.unbox(module.init(jax.random.key(0), tokens)["params"])
  tx = optax.adam(1e-2)

  @jax.jit
  def step(params, tokens):
    loss, grads = jax.value_and_grad(_loss)(params, module, tokens)
    updates, _ = tx.update(grads, tx.init(params), params)
    return loss, optax.apply_updates(params, updates)

  loss, params = step(params, tokens)
  return float(loss), params


@pytest.mark.parametrize("shape", slow_except(MESHES, (2, 2, 2)))  # fast: all three axes at once
def test_sharded_adam_step_equals_single_device_step(tiny, reference_step, shape):
  module, tokens, boxed = tiny
  config = _config(*shape)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  tx = optax.adam(1e-2)
  p_sh = sharding.param_shardings(boxed, mesh, rules)

  def init(key):
    params = nn.meta.unbox(module.init(key, tokens)["params"])
    return params, tx.init(params)

  abstract = jax.eval_shape(init, jax.random.key(0))
  state_sh = sharding.state_shardings(abstract, boxed, mesh, rules)
  params, opt_state = jax.jit(init, out_shardings=state_sh)(jax.random.key(0))

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(_loss)(params, module, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state

  step = jax.jit(
      sharding.with_rules(step, mesh, rules),
      in_shardings=(p_sh, state_sh[1], sharding.batch_sharding(mesh)),
      out_shardings=(sharding.replicated(mesh), p_sh, state_sh[1]),
      donate_argnums=(0, 1),
  )
  lowered = step.lower(params, opt_state, tokens).as_text()
  assert "sharding_constraint" in lowered and '{"data", "fsdp"}' in lowered
  loss, new_params, _ = step(
      params, opt_state, jax.device_put(tokens, sharding.batch_sharding(mesh))
  )
  ref_loss, ref_params = reference_step
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  for name, ref in ref_params.items():
    assert new_params[name].sharding.spec == p_sh[name].spec
    np.testing.assert_allclose(np.asarray(new_params[name]), np.asarray(ref), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- dry run, hosts


def test_describe_shardings_lists_specs_and_per_device_bytes(tiny):
  _, _, boxed = tiny
  config = _config(2, 2, 2)
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, nn.meta.unbox(boxed))
  text = sharding.describe_shardings(boxed, mesh, rules, opt_state)
  assert "mesh: data=2, fsdp=2, sequence=1, tensor=2 (8 devices)" in text
  query = next(line for line in text.splitlines() if line.startswith("query"))
  assert "(embed, heads, head_dim)" in query and "P('fsdp', 'tensor', None)" in query
  assert "(8, 2, 4)" in query
  total = sharding.total_bytes(boxed)
  assert f"param bytes: {total:,} total" in text and "optimizer state bytes:" in text
