"""Model-level properties: causality, padding invariance, packing, dtypes, axis names."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.variants import B, DECODERS, ENCDECS, T, VARIANTS
from tests.models.variants import forward, model_and_params, tokens
from tx_jax.models import build
from tests.tiers import slow_except

@pytest.mark.parametrize("name", DECODERS + ENCDECS)
def test_causality_bit_for_bit(name):
  """Changing target token t changes no logit at positions < t, bit for bit."""
  x = tokens(0)
  x2 = x.at[:, 6].set((x[:, 6] + 7) % 53)
  if VARIANTS[name].family == "encdec":
    src = tokens(1, (B, 7))
    a, b = forward(name, src, x), forward(name, src, x2)
  else:
    a, b = forward(name, x), forward(name, x2)
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert not np.allclose(a[:, 6:], b[:, 6:])


def _with_padding(x, extra):
  seg = jnp.ones_like(x)
  pad = jnp.zeros((x.shape[0], extra), x.dtype)
  return jnp.concatenate([x, pad], 1), jnp.concatenate([seg, pad], 1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padding_invariance(name):
  """Extra padding changes no logit of real tokens."""
  config = VARIANTS[name]
  x = tokens(2)
  padded, seg = _with_padding(x, 5)
  if config.family == "encdec":
    src = tokens(3, (B, 7))
    src_padded, src_seg = _with_padding(src, 4)
    ref = forward(name, src, x)
    out = forward(name, src_padded, padded, encoder_segment_ids=src_seg, decoder_segment_ids=seg)
  else:
    ref = forward(name, x)
    out = forward(name, padded, segment_ids=seg)
  np.testing.assert_allclose(out[:, :T], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packing_equals_separate_sequences(name):
  """Two sequences packed with segment ids and restarting positions = each one alone."""
  config = VARIANTS[name]
  a, b = tokens(4, (1, 6)), tokens(5, (1, 4))
  packed = jnp.concatenate([a, b], 1)
  seg = jnp.array([[1] * 6 + [2] * 4])
  pos = jnp.array([list(range(6)) + list(range(4))])
  if config.family == "encdec":
    sa, sb = tokens(6, (1, 5)), tokens(7, (1, 3))
    src = jnp.concatenate([sa, sb], 1)
    src_seg = jnp.array([[1] * 5 + [2] * 3])
    src_pos = jnp.array([list(range(5)) + list(range(3))])
    out = forward(
        name,
        src,
        packed,
        encoder_segment_ids=src_seg,
        decoder_segment_ids=seg,
        encoder_positions=src_pos,
        decoder_positions=pos,
    )
    alone_a, alone_b = forward(name, sa, a), forward(name, sb, b)
  else:
    out = forward(name, packed, segment_ids=seg, positions=pos)
    alone_a, alone_b = forward(name, a), forward(name, b)
  np.testing.assert_allclose(out[:, :6], alone_a, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(out[:, 6:], alone_b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_parameter_has_logical_axis_names(name):
  _, _, boxed = model_and_params(name)
  leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert leaves
  for leaf in leaves:
    assert isinstance(leaf, nn.LogicallyPartitioned), leaf
    assert len(leaf.names) == leaf.value.ndim


@pytest.mark.parametrize("name", slow_except(["llama", "t5", "bert"], "bert"))
def test_bf16_compute_with_f32_params_stays_close(name):
  config = VARIANTS[name]
  module = build(config)
  bf16 = build(type(config)(**{**config.__dict__, "dtype": "bfloat16"}))
  _, params, _ = model_and_params(name)
  args = (tokens(8, (B, 7)), tokens(9)) if config.family == "encdec" else (tokens(9),)
  ref = np.asarray(module.apply({"params": params}, *args))
  out = bf16.apply({"params": params}, *args)
  assert out.dtype == jnp.float32  # logits stay float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  err = np.abs(np.asarray(out) - ref).max() / np.abs(ref).max()
  # bf16 keeps 8 mantissa bits (relative rounding 2^-8 = 0.004 per op). Measured max relative
  # error: llama 0.0067, t5 0.0079, bert 0.0105, so 0.05 leaves >= 4.7x margin.
  assert err < 0.05, err


def test_dropout_only_in_training():
  config = VARIANTS["gpt2"]
  drop = build(
      type(config)(**{**config.__dict__, "dropout_rate": 0.3, "attention_dropout_rate": 0.3})
  )
  _, params, _ = model_and_params("gpt2")
  x = tokens(10)
  eval_a = drop.apply({"params": params}, x)
  np.testing.assert_allclose(np.asarray(eval_a), forward("gpt2", x), atol=1e-6)  # jit vs eager
  train = drop.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.PRNGKey(0)})
  assert not np.allclose(np.asarray(train), np.asarray(eval_a))


def test_encoder_heads():
  config = VARIANTS["bert"]
  x = tokens(11)
  logits = forward("bert", x, token_type_ids=jnp.ones_like(x))
  assert logits.shape == (B, T, config.vocab_size)
  assert not np.allclose(logits, forward("bert", x))  # token types matter
  cls = build(type(config)(**{**config.__dict__, "head": "classification", "num_classes": 3}))
  variables = cls.init(jax.random.PRNGKey(0), x)
  assert cls.apply(variables, x).shape == (B, 3)
  bare = build(type(config)(**{**config.__dict__, "head": "none"}))
  seq, pooled = bare.apply(bare.init(jax.random.PRNGKey(0), x), x)
  assert seq.shape == (B, T, config.d_model) and pooled.shape == (B, config.d_model)


@pytest.mark.parametrize("name", slow_except(["gpt2", "t5"], "gpt2"))
@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_over_layers_equals_unrolled(name, remat):
  """nn.scan with stacked params computes exactly what the unrolled stack computes."""
  config = VARIANTS[name]
  scanned = build(type(config)(**{**config.__dict__, "scan_layers": True, "remat_policy": remat}))
  _, params, _ = model_and_params(name)

  def stack(tree):
    layers = sorted((k for k in tree if k.startswith("layer_")), key=lambda k: int(k[6:]))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[k] for k in layers])
    return {"layers": {"layer": stacked}}

  scanned_params = dict(params)
  for stack_name in ("stack", "encoder", "decoder"):
    if stack_name in params:
      scanned_params[stack_name] = stack(params[stack_name])
  args = (tokens(12, (B, 7)), tokens(13)) if config.family == "encdec" else (tokens(13),)
  np.testing.assert_allclose(
      np.asarray(scanned.apply({"params": scanned_params}, *args)), forward(name, *args), atol=1e-5
  )
