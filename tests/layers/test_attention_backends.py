"""Every attention backend equals `dense`, forward and gradients (q, k, v, bias parameters),
for every mask kind, GQA/MQA, T5 relative bias and ALiBi, on lengths that the block sizes
do not divide (the reference, `dense`, is checked against numpy in test_attention.py); and
`AttentionSpec` materialises the same mask and bias as an independent numpy construction of
the rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.layers import masks
from tx_jax.layers import ops
from tx_jax.layers.attention import BACKENDS, AttentionSpec, get_backend
from tx_jax.layers.attention import backends as attention_backends
from tx_jax.layers.attention.dense import dense, dense_attention
from tx_jax.layers.attention.blockwise import blockwise_attention
from tx_jax.layers.attention.pallas import pallas_attention
from tx_jax.layers.positions import (
    AlibiBias,
    RelativeBias,
    RelativePositionBias,
    alibi_bias,
    alibi_slopes,
)

B, T, S, N, H = 2, 11, 9, 4, 8  # 11 and 9 are not multiples of the test blocks (4, 3)
SCALE = 0.35
RNG = np.random.default_rng(0)
TABLE = jnp.asarray(RNG.standard_normal((8, N)), jnp.float32)
SLOPES = jnp.asarray(alibi_slopes(N))


def _segments(length, kind):
  if kind == "one":
    return jnp.ones((B, length), jnp.int32)
  if kind == "padding":  # row 1 ends with padding
    return jnp.array([[1] * length, [1] * (length - 4) + [0] * 4], jnp.int32)
  # packing: three documents in row 0, two and padding in row 1
  a, b = length // 3, 2 * length // 3
  return jnp.array(
      [[1] * a + [2] * (b - a) + [3] * (length - b), [1] * a + [2] * (b - a) + [0] * (length - b)],
      jnp.int32,
  )


def _bias(kind, bidirectional=True):
  if kind == "t5":
    return RelativeBias(TABLE, max_distance=16, bidirectional=bidirectional)
  if kind == "alibi":
    return AlibiBias(SLOPES)
  return None


def _spec(kind, bias_kind=None):
  """Named mask kinds; all but cross-attention are self-attention over T tokens."""
  if kind == "cross":
    # Decoder segment 3 of row 0 has no encoder segment 3: those queries see no key.
    q_seg = _segments(T, "packing")
    k_seg = jnp.array([[1] * 4 + [2] * 5, [1] * 3 + [2] * 4 + [0] * 2], jnp.int32)
    return AttentionSpec.cross_attention(q_seg, k_seg)
  causal = kind.startswith("causal")
  segments = {"none": "one", "causal": "one", "padding": "padding"}.get(kind, "packing")
  positions = None
  if "packing" in kind:  # positions restart per document; causality stays by index
    seg = np.asarray(_segments(T, "packing"))
    positions = jnp.asarray(
        [[int(np.sum(row[:t] == row[t])) for t in range(T)] for row in seg], jnp.int32
    )
  window = 3 if "window" in kind else None
  return AttentionSpec.self_attention(
      _segments(T, segments),
      positions,
      causal=causal,
      window=window,
      bias=_bias(bias_kind, bidirectional=not causal),
  )


MASK_KINDS = [
    "none",
    "causal",
    "padding",
    "packing",
    "causal+packing",
    "causal+window",
    "window+packing",
    "cross",
]


def _qkv(num_kv_heads, key_length=T, seed=1):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H))
  k = rng.standard_normal((B, key_length, num_kv_heads, H))
  v = rng.standard_normal((B, key_length, num_kv_heads, H))
  return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(attend, spec, q, k, v):
  """Output, and the gradients of sum(out * w) w.r.t. q, k, v and the bias parameters."""
  w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v, bias):
    return jnp.sum(attend(q, k, v, spec.replace(bias=bias), scale=SCALE) * w)

  out = attend(q, k, v, spec, scale=SCALE)
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, spec.bias)
  return out, grads


def _autodiff_dense(q, k, v, spec, *, scale):
  """The reference: `dense_attention` on the spec's whole mask and bias, under autodiff."""
  return dense_attention(q, k, v, spec.mask(), spec.bias_logits(), scale=scale)


def _assert_equal_to_dense(attend, spec, q, k, v, atol=2e-5, reference=dense):
  out, grads = _loss_and_grads(attend, spec, q, k, v)
  ref_out, ref_grads = _loss_and_grads(reference, spec, q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=atol, rtol=1e-5)
  names = ["dq", "dk", "dv", "dbias"]
  for name, got, want in zip(names, grads, ref_grads):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      scale = max(1.0, float(np.max(np.abs(np.asarray(r)))))
      np.testing.assert_allclose(
          np.asarray(g), np.asarray(r), atol=atol * scale, rtol=1e-5, err_msg=name
      )


def _blockwise(block_q=4, block_k=3):
  def attend(q, k, v, spec, *, scale, kernels=ops.get("plain")):
    return blockwise_attention(
        q, k, v, spec, scale=scale, block_q=block_q, block_k=block_k, kernels=kernels
    )

  return attend


# Each mask kind with one head layout: N (MHA), 2 (GQA) or 1 (MQA); every layout appears.
MASK_CASES = list(zip(MASK_KINDS, [N, 1, 2, N, 2, 1, 2, 1]))


@pytest.mark.parametrize("kind,num_kv_heads", MASK_CASES)
def test_blockwise_equals_dense(kind, num_kv_heads):
  spec = _spec(kind)
  q, k, v = _qkv(num_kv_heads, key_length=S if kind == "cross" else T)
  _assert_equal_to_dense(_blockwise(), spec, q, k, v)


@pytest.mark.parametrize(
    "kind,bias_kind,num_kv_heads",
    [
        ("none", "t5", N),
        ("causal+packing", "t5", 2),
        ("causal", "alibi", 1),
        ("window+packing", "alibi", 2),
    ],
)
def test_blockwise_equals_dense_with_bias(kind, bias_kind, num_kv_heads):
  spec = _spec(kind, bias_kind)
  _assert_equal_to_dense(_blockwise(), spec, *_qkv(num_kv_heads))


@pytest.mark.parametrize("blocks", [(1, 1), (16, 16), (8, 2)])
def test_blockwise_any_block_size(blocks):
  """One-token blocks, one block larger than the sequence, unequal query/key blocks."""
  spec = _spec("causal+packing", "t5")
  _assert_equal_to_dense(_blockwise(*blocks), spec, *_qkv(2))


@pytest.mark.parametrize("kernels", ["plain", "cpu"])
def test_blockwise_equals_dense_under_every_kernel_set(kernels):
  """The `blockwise` backend's contractions go through the kernel set's einsum."""
  spec = _spec("causal+packing", "t5")
  attend = functools.partial(_blockwise(), kernels=ops.get(kernels))
  _assert_equal_to_dense(attend, spec, *_qkv(2))


def test_rows_with_no_visible_key_give_zero():
  spec = _spec("cross")
  q, k, v = _qkv(2, key_length=S)
  empty_BT = ~np.asarray(spec.mask()[:, 0]).any(-1)
  assert empty_BT.any()  # the case is really there
  for name in ("dense", "blockwise"):
    attend = jax.jit(get_backend(name), static_argnames="scale")
    out = np.asarray(attend(q, k, v, spec, scale=SCALE))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[empty_BT], 0.0)


def test_blockwise_skips_fully_masked_blocks():
  """NaN values in a key block that a causal query block cannot see stay out of its output
  and gradients, which only holds if that block is never computed (0 weight x NaN is NaN)."""
  spec = AttentionSpec.self_attention(jnp.ones((B, 8), jnp.int32), causal=True)
  q, k, v = (x[:, :8] for x in _qkv(2))
  v = v.at[:, 4:].set(jnp.nan)
  attend = lambda q: blockwise_attention(q, k, v, spec, scale=SCALE, block_q=4, block_k=4)  # noqa
  out = jax.jit(attend)(q)
  assert np.isfinite(np.asarray(out[:, :4])).all()
  assert np.isnan(np.asarray(out[:, 4:])).all()
  dq = jax.jit(jax.grad(lambda q: jnp.sum(attend(q)[:, :4])))(q)
  assert np.isfinite(np.asarray(dq[:, :4])).all()


def _avals(jaxpr):
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield var.aval
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _avals(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _avals(sub)


def test_blockwise_never_builds_a_query_by_key_array():
  """No value in the forward+backward program has both the query and the key length."""
  q_len, k_len = 96, 80
  spec = AttentionSpec.self_attention(jnp.ones((1, q_len), jnp.int32), causal=True)
  spec = spec.with_keys(*(jnp.ones((1, k_len), jnp.int32),) * 3)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, q_len, 2, 4)), jnp.float32)
  k = v = jnp.asarray(rng.standard_normal((1, k_len, 1, 4)), jnp.float32)
  loss = lambda q, k, v: jnp.sum(  # noqa: E731
      blockwise_attention(q, k, v, spec, scale=1.0, block_q=32, block_k=16)
  )
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  shapes = [tuple(a.shape) for a in _avals(jaxpr.jaxpr) if hasattr(a, "shape")]
  assert any(32 in s and 16 in s for s in shapes)  # blocks are there
  assert not [s for s in shapes if q_len in s and k_len in s]


def test_spec_mask_and_bias_match_the_rules_in_numpy():
  """Mask and bias of the description against a per-element numpy construction."""
  spec = _spec("causal+window", "alibi").replace(
      query_segment_ids=_segments(T, "packing"), key_segment_ids=_segments(T, "packing")
  )
  seg = np.asarray(spec.query_segment_ids)
  pos = np.asarray(spec.query_positions)
  mask = np.zeros((B, T, T), bool)
  bias = np.zeros((B, N, T, T), np.float32)
  for b in range(B):
    for t in range(T):
      for s in range(T):
        mask[b, t, s] = seg[b, t] == seg[b, s] != 0 and 0 <= t - s < 3
        bias[b, :, t, s] = -np.asarray(SLOPES) * abs(pos[b, t] - pos[b, s])
  np.testing.assert_array_equal(np.asarray(spec.mask()[:, 0]), mask)
  np.testing.assert_allclose(np.asarray(spec.bias_logits()), bias, rtol=1e-6)


def test_spec_equals_the_tensor_builders():
  """The description reproduces layers.masks and positions' T5 / ALiBi tensors."""
  seg = _segments(T, "packing")
  pos = jnp.asarray(np.random.default_rng(3).integers(0, 40, (B, T)), jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(T), (B, T))
  spec = AttentionSpec.self_attention(seg, pos, causal=True, bias=AlibiBias(SLOPES))
  want = masks.combine(masks.segment_mask(seg, seg), masks.causal_mask(idx, idx))
  np.testing.assert_array_equal(np.asarray(spec.mask()), np.asarray(want))
  np.testing.assert_allclose(spec.bias_logits(), alibi_bias(pos, pos, N), rtol=1e-6)
  module = RelativePositionBias(num_heads=N, num_buckets=8, max_distance=16, bidirectional=False)
  described = module.apply({"params": {"rel_embedding": TABLE}})
  np.testing.assert_array_equal(described.table, TABLE)
  tensor = RelativeBias(TABLE, max_distance=16, bidirectional=False).logits(pos, pos)
  spec = spec.replace(bias=RelativeBias(TABLE, max_distance=16, bidirectional=False))
  np.testing.assert_allclose(spec.bias_logits(), tensor, rtol=1e-6)


def test_blocks_of_the_spec_are_blocks_of_the_mask():
  spec = _spec("causal+packing", "t5")
  block = spec.queries(4, 5).keys(2, 6)
  np.testing.assert_array_equal(block.mask(), spec.mask()[:, :, 4:9, 2:8])
  np.testing.assert_allclose(block.bias_logits(), spec.bias_logits()[:, :, 4:9, 2:8])


PALLAS_KINDS = ["causal+packing", "padding"]
# jax 0.12.1 removed the Pallas GPU attention kernel (tx_jax supports jax up to 0.12.x).
PALLAS_MISSING = attention_backends.missing_kernel("pallas")
needs_pallas_kernel = pytest.mark.skipif(
    PALLAS_MISSING is not None, reason=f"this jax has no {PALLAS_MISSING}"
)


@needs_pallas_kernel
@pytest.mark.parametrize("kind", PALLAS_KINDS)
def test_pallas_equals_dense_in_interpret_mode(kind):
  """The Pallas GPU kernel's numerics on CPU; GQA, odd length, padding rows."""
  attend = lambda q, k, v, spec, *, scale: pallas_attention(  # noqa: E731
      q, k, v, spec, scale=scale, interpret=True
  )
  _assert_equal_to_dense(attend, _spec(kind), *_qkv(2 if kind == "padding" else 1))


@pytest.mark.parametrize(
    "spec,what",
    [
        (_spec("cross"), "not its keys"),
        (_spec("causal", "t5"), "RelativeBias"),
        (_spec("causal", "alibi"), "AlibiBias"),
        (_spec("causal+window"), "sliding window"),
    ],
)
def test_pallas_names_what_it_does_not_support(spec, what):
  q, k, v = _qkv(N, key_length=spec.key_length)
  with pytest.raises(ValueError, match=what):
    pallas_attention(q, k, v, spec, scale=SCALE, interpret=True)


@pytest.mark.skipif(PALLAS_MISSING is None, reason="this jax ships the Pallas GPU kernel")
def test_pallas_names_the_missing_kernel():
  with pytest.raises(ValueError, match="does not ship; use 'cudnn' or 'blockwise'"):
    pallas_attention(*_qkv(N), _spec("causal"), scale=SCALE, interpret=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off GPU")
@pytest.mark.parametrize("name", ["cudnn", "pallas"])
def test_gpu_backends_say_they_need_a_gpu(name):
  with pytest.raises(ValueError, match="GPU"):
    BACKENDS[name](*_qkv(N), _spec("causal"), scale=SCALE)


def test_dropout_is_refused_where_unsupported():
  with pytest.raises(ValueError, match="attention_dropout_rate"):
    blockwise_attention(
        *_qkv(N), _spec("causal"), scale=SCALE, dropout_rate=0.1, deterministic=False
    )


def _splash(q, k, v, spec, *, scale):
  from tx_jax.layers.attention.splash import splash_attention  # pylint: disable=g-import-not-at-top

  return splash_attention(q, k, v, spec, scale=scale, interpret=True)


# The TPU kernel in TPU interpret mode: each case compiles a forward and a backward kernel
# interpreted on the CPU, so the fast tier keeps one case that covers packing, padding,
# causality and GQA; the other mask kinds and head layouts run in the slow tier.
SPLASH_CASES = [pytest.param("causal+packing", 2)] + [
    pytest.param(kind, heads, marks=pytest.mark.slow)
    for kind, heads in MASK_CASES
    if kind != "causal+packing"
]


@pytest.mark.parametrize("kind,num_kv_heads", SPLASH_CASES)
def test_splash_equals_dense_in_tpu_interpret_mode(kind, num_kv_heads):
  """The TPU splash kernel's numerics on CPU: forward and gradients, odd lengths."""
  spec = _spec(kind)
  _assert_equal_to_dense(_splash, spec, *_qkv(num_kv_heads, key_length=spec.key_length))


@pytest.mark.parametrize(
    "spec,what",
    [
        (_spec("causal", "t5"), "RelativeBias"),
        (_spec("causal", "alibi"), "AlibiBias"),
        (_spec("causal").replace(same_tokens=False), "array positions"),
    ],
)
def test_splash_names_what_it_does_not_support(spec, what):
  q, k, v = _qkv(N, key_length=spec.key_length)
  with pytest.raises(ValueError, match=what):
    _splash(q, k, v, spec, scale=SCALE)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="checks the error off TPU")
def test_splash_says_it_needs_a_tpu():
  with pytest.raises(ValueError, match="needs a TPU"):
    BACKENDS["splash"](*_qkv(N), _spec("causal"), scale=SCALE)
