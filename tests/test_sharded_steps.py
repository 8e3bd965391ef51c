"""Every model family trains identically on every mesh: sharded step == single-device step.

For GPT, LLaMA, BERT (MLM), the original Transformer and T5 at test scale, on meshes
(data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2), (1,2,4): one real trainer step
(tx_jax.train.steps.train_step) jitted with the sharding rules gives the loss and updated
params of the same step jitted with no mesh at all; every parameter lands on the devices as
the rules say; FSDP holds about 1/fsdp of the param and optimizer-state bytes.

The step uses SGD with momentum, whose first update is linear in the gradient, so the test
measures the sharded gradient. Adam's first update lr * g / (|g| + eps) is ill-conditioned
here: gradients that are exactly zero in exact arithmetic (the key-projection bias, since
softmax ignores a per-query shift) come out as ~1e-9 float noise, which Adam turns into
O(lr) updates of either sign.
"""

import functools
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import bert, gpt, t5, transformer
from tx_jax import checkpoint as checkpoint_lib
from tx_jax import models, sharding
from tx_jax.benchmarks import sharding_table
from tx_jax.train import loop, state as state_lib, steps

# Whole-model sharded steps: minutes on 2 cores, so outside the fast tier (tests/test_sharding.py
# covers sharding.py there).
pytestmark = pytest.mark.slow

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
BATCH, LEN = 8, 8
LR = 0.5  # large, so the updated params differ from the init by a measurable amount

# The default rules, written out independently: the mesh axis each logical name must use.
EXPECTED_AXIS = {
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": "fsdp",
    "head_dim": None,
    "qkv": None,
    "layers": None,
    "relpos_buckets": None,
    "type_vocab": None,
    "position": None,
}


def _family_config(name: str):
  """A test-scale preset of each family; widths divide by every test mesh's axes."""
  config = {
      "gpt": lambda: gpt.get_config("tiny"),
      "llama": lambda: gpt.get_config("llama-tiny"),
      "bert": lambda: bert.get_config("tiny"),
      "transformer": lambda: transformer.get_config("tiny"),
      "t5": lambda: t5.get_config("tiny"),
  }[name]()
  m = config.model
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 4, 4, 8, 64
  m.num_layers, m.max_len = 1, 16  # one layer: compile time dominates these tests
  if m.family == "encdec":
    m.num_decoder_layers = 1
  if name == "llama":  # keep grouped-query attention: 8 query heads share 4 kv heads
    m.num_heads, m.num_kv_heads, m.head_dim = 8, 4, 4
  if name == "gpt":  # dropout on: its random bits must not depend on the mesh
    m.dropout_rate = m.attention_dropout_rate = 0.1
  config.data.global_batch_size = config.data.eval_global_batch_size = BATCH
  config.data.seq_len = config.data.source_len = config.data.target_len = LEN
  return config


def _batch(config) -> dict:
  """A batch following ARCHITECTURE.md's contract: packed rows, padding, real weights."""
  rng = np.random.default_rng(0)
  vocab = config.model.vocab_size

  def ids_segments_positions():
    ids = rng.integers(4, vocab, (BATCH, LEN)).astype(np.int32)
    seg = np.ones((BATCH, LEN), np.int32)
    seg[1, LEN // 2 :] = 2  # row 1 packs two documents
    seg[2, LEN - 3 :] = 0  # row 2 ends in padding
    pos = np.tile(np.arange(LEN, dtype=np.int32), (BATCH, 1))
    pos[1, LEN // 2 :] -= LEN // 2
    ids[seg == 0] = 0
    pos[seg == 0] = 0
    return ids, seg, pos

  family = config.model.family
  if family == "encdec":
    src, src_seg, src_pos = ids_segments_positions()
    tgt, tgt_seg, tgt_pos = ids_segments_positions()
    dec_in = np.where(tgt_seg > 0, np.roll(tgt, 1, axis=1), 0).astype(np.int32)
    dec_in[:, 0] = 1
    return dict(
        encoder_inputs=src,
        encoder_segment_ids=src_seg,
        encoder_positions=src_pos,
        decoder_inputs=dec_in,
        decoder_segment_ids=tgt_seg,
        decoder_positions=tgt_pos,
        targets=tgt,
        weights=(tgt_seg > 0).astype(np.float32),
    )
  ids, seg, pos = ids_segments_positions()
  if family == "decoder":
    targets = np.where(seg > 0, np.roll(ids, -1, axis=1), 0).astype(np.int32)
    return dict(
        inputs=ids,
        targets=targets,
        weights=(targets > 0).astype(np.float32),
        segment_ids=seg,
        positions=pos,
    )
  selected = (rng.random((BATCH, LEN)) < 0.3) & (seg > 0)
  masked = np.where(selected, 3, ids).astype(np.int32)
  return dict(
      inputs=masked,
      token_type_ids=(pos >= LEN // 2).astype(np.int32),
      segment_ids=seg,
      positions=pos,
      targets=np.where(selected, ids, 0).astype(np.int32),
      weights=selected.astype(np.float32),
  )


def _parts(config):
  """Module-free pieces of the trainer's step, exactly as tx_jax.train.loop wires them."""
  module = models.build(config.model)
  apply_fn = loop.make_apply_fn(module, config.model)
  tx, schedule = optax.sgd(LR, momentum=0.9), optax.constant_schedule(LR)
  example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in _batch(config).items()}

  def init_params(rng):
    args, kwargs = models.model_inputs(config.model, example)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  init_fn = state_lib.make_init_fn(init_params, tx, config.seed)
  step = functools.partial(steps.train_step, apply_fn=apply_fn, tx=tx, schedule=schedule)
  return init_params, init_fn, step


FAMILIES = ["gpt", "llama", "bert", "transformer", "t5"]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request):
  """The single-device run: init and one step jitted with no mesh and no rules."""
  config = _family_config(request.param)
  _, init_fn, step = _parts(config)
  state0 = jax.jit(init_fn)()
  state1, metrics = jax.jit(step)(state0, _batch(config))
  moved = [
      np.max(np.abs(a - b))
      for a, b in zip(
          jax.tree.leaves(jax.device_get(state1.params)),
          jax.tree.leaves(jax.device_get(state0.params)),
      )
  ]
  # Guards against a vacuous comparison (e.g. a zero learning rate). Not every leaf moves:
  # BERT's pooler gets no gradient from the MLM loss.
  assert np.mean(np.array(moved) > 0) > 0.9, "the reference step must change the params"
  return request.param, config, jax.device_get(state0), jax.device_get(state1), metrics


DELTAS = {}  # (family, mesh) -> max relative delta, for the report table


def _rel(a, b) -> float:
  """max |a - b| / max |b| over whole trees: the norm-wise (infinity-norm) relative difference.

  Per-element or per-leaf ratios are meaningless for entries that are zero in exact
  arithmetic (the key bias's gradient), which come out as float noise on both sides.
  """
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
  diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
  return diff / max(max(float(np.max(np.abs(y))) for y in b), 1e-30)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_step_equals_single_device_step(reference, mesh_shape):
  family, config, ref0, ref1, ref_metrics = reference
  config = config.copy_and_resolve_references()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  sharding.validate(config, jax.device_count())
  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  init_params, init_fn, step = _parts(config)
  boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  abstract = jax.eval_shape(init_fn)
  shardings = sharding.state_shardings(abstract, boxed, mesh, rules)
  state0 = jax.jit(init_fn, out_shardings=shardings)()
  batch_sh = sharding.batch_sharding(mesh)
  jstep = jax.jit(
      sharding.with_rules(step, mesh, rules),
      in_shardings=(shardings, batch_sh),
      out_shardings=(shardings, sharding.replicated(mesh)),
      donate_argnums=0,
  )
  batch = jax.device_put(_batch(config), batch_sh)

  # The sharded init is the same init.
  for a, b in zip(jax.tree.leaves(jax.device_get(state0.params)), jax.tree.leaves(ref0.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

  # Parameters (and their Adam moments) sit on the devices as the rules say.
  sizes = dict(mesh.shape)
  names = jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
  )[0]
  arrays = jax.tree_util.tree_leaves(state0.params)
  assert len(names) == len(arrays)
  for (path, box), array in zip(names, arrays):
    assert isinstance(box, nn.LogicallyPartitioned), f"{path} has no logical axis names"
    expected = tuple(EXPECTED_AXIS[n] for n in box.names)
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    assert spec == expected, (path, spec, expected)
    local = tuple(d // (sizes[a] if a else 1) for d, a in zip(array.shape, expected))
    assert {s.data.shape for s in array.addressable_shards} == {local}, path

  state1, metrics = jstep(state0, batch)
  loss = float(metrics["loss_sum"] / metrics["weight_sum"])
  ref_loss = float(ref_metrics["loss_sum"] / ref_metrics["weight_sum"])
  new, ref = jax.device_get(state1.params), ref1.params
  deltas = (abs(loss - ref_loss) / abs(ref_loss), _rel(new, ref))
  # The updates themselves (new - init), i.e. -LR x the gradient, agree closely too.
  updates = _rel(
      jax.tree.map(np.subtract, new, ref0.params), jax.tree.map(np.subtract, ref, ref0.params)
  )
  DELTAS[(family, mesh_shape)] = (*deltas, updates)
  assert max(deltas) < 1e-5, (family, mesh_shape, deltas)
  assert updates < 1e-4, (family, mesh_shape, updates)
  for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(state0.params)):
    assert a.sharding.spec == b.sharding.spec

  if mesh_shape == (1, 8, 1):  # FSDP: each device holds ~1/8 of params and momentum
    # Exactly: leaves with an `embed` dim split 8 ways; the few without one (biases over
    # heads / mlp / vocab, T5's relative-position table) stay whole.
    expected = sum(
        math.prod(box.value.shape) * 4 // (8 if "embed" in box.names else 1) for _, box in names
    )
    total = sum(x.nbytes for x in jax.tree.leaves(state1.params))
    for tree in (state1.params, state1.opt_state):
      held = sum(
          s.data.nbytes
          for x in jax.tree.leaves(tree)
          for s in x.addressable_shards
          if s.device == mesh.devices.flat[0]
      )
      assert held == expected, (family, held, expected)
      assert held <= 1.25 * total / 8, (family, held, total)


def test_checkpoint_restores_bitwise_onto_other_meshes_and_one_device(tmp_path):
  """Save on (2,2,2); restore onto (1,2,4), (8,1,1) and one device; bitwise equal; train on."""
  config = _family_config("gpt")
  init_params, init_fn, step = _parts(config)
  boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  abstract = jax.eval_shape(init_fn)

  def on(mesh_shape, devices=None):
    c = config.copy_and_resolve_references()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh_shape
    mesh, rules = sharding.make_mesh(c.mesh, devices), sharding.logical_rules(c)
    shardings = sharding.state_shardings(abstract, boxed, mesh, rules)
    jstep = jax.jit(
        sharding.with_rules(step, mesh, rules),
        in_shardings=(shardings, sharding.batch_sharding(mesh)),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    return shardings, jstep, jax.device_put(_batch(config), sharding.batch_sharding(mesh))

  shardings, jstep, batch = on((2, 2, 2))
  state, _ = jstep(jax.jit(init_fn, out_shardings=shardings)(), batch)  # non-zero momentum
  ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", config.checkpoint)
  ckpt.save(1, state)
  ckpt.wait()
  saved = checkpoint_lib.np_tree(state)
  _, metrics = jstep(state, batch)  # the step after the checkpoint, on the saving mesh
  next_loss = float(metrics["loss_sum"] / metrics["weight_sum"])

  for mesh_shape, devices in [((1, 2, 4), None), ((8, 1, 1), None), ((1, 1, 1), jax.devices()[:1])]:
    shardings, jstep, batch = on(mesh_shape, devices)
    restored, restored_step = ckpt.restore_latest(
        checkpoint_lib.abstract_with_shardings(abstract, shardings)
    )
    assert restored_step == 1
    for got, want, target in zip(
        jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(shardings)
    ):
      assert got.sharding.is_equivalent_to(target, got.ndim), (mesh_shape, got.sharding, target)
      got = np.asarray(got)
      assert got.dtype == want.dtype and got.shape == want.shape
      assert got.tobytes() == want.tobytes(), mesh_shape  # bitwise
    _, metrics = jstep(restored, batch)
    loss = float(metrics["loss_sum"] / metrics["weight_sum"])
    assert np.isfinite(loss) and abs(loss - next_loss) <= 1e-5 * abs(next_loss), (
        mesh_shape,
        loss,
        next_loss,
    )
  ckpt.close()


@pytest.fixture(scope="module", autouse=True)
def _equivalence_table_report():
  """After the module, writes the mesh x family table when TX_JAX_SHARDING_TABLE names a file."""
  yield
  path = os.environ.get("TX_JAX_SHARDING_TABLE")
  if path and DELTAS:
    sharding_table.write(DELTAS, path)
