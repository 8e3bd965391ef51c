"""The `cpu` kernels' `dense` on contractions read in place by MKL (tx_jax/cpu/
chunked_attention.py, on einsum.in_place_einsum) against XLA's autodiff of the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cpu import mkl
from tx_jax.cpu import gemm as cpu_gemm
from tx_jax.cpu.chunked_attention import dense_attention as dense
from tx_jax.layers.attention.dense import dense_attention
from tx_jax.layers.attention import AttentionSpec
from tx_jax.layers.positions import AlibiBias, RelativeBias, alibi_slopes


pytestmark = mkl.requires_mkl

RNG = np.random.default_rng(0)


def _normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


B, T, N, H = 2, 128, 4, 32  # two causal query chunks of 64; large enough for MKL
SCALE = 0.3


def _segments(kind, length=T):
  if kind == "padding":  # row 1 ends with padding: those queries see no key
    return jnp.array([[1] * length, [1] * (length - 24) + [0] * 24], jnp.int32)
  a, b = length // 3, 2 * length // 3
  return jnp.array(
      [[1] * a + [2] * (b - a) + [3] * (length - b), [1] * a + [2] * (b - a) + [0] * (length - b)],
      jnp.int32,
  )


def _spec(kind):
  table = _normal(8, N)
  if kind == "causal":
    return AttentionSpec.self_attention(jnp.ones((B, T), jnp.int32), causal=True)
  if kind == "causal+packing+t5":
    return AttentionSpec.self_attention(
        _segments("packing"), causal=True,
        bias=RelativeBias(table, max_distance=16, bidirectional=False),
    )
  if kind == "causal+alibi":
    return AttentionSpec.self_attention(
        jnp.ones((B, T), jnp.int32), causal=True, bias=AlibiBias(jnp.asarray(alibi_slopes(N)))
    )
  if kind == "padding+t5":  # one chunk: not causal
    return AttentionSpec.self_attention(
        _segments("padding"), causal=False, bias=RelativeBias(table, max_distance=16, bidirectional=True)
    )
  # cross: 96 keys; row 0's third decoder segment has no encoder segment 3
  keys = jnp.array([[1] * 40 + [2] * 56, [1] * 30 + [2] * 50 + [0] * 16], jnp.int32)
  return AttentionSpec.cross_attention(_segments("packing"), keys)


def _outputs_and_gradients(spec, q, k, v, attend):
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v, bias):
    return jnp.sum(attend(q, k, v, spec.replace(bias=bias), scale=SCALE) * w)

  fn = jax.jit(lambda q, k, v: (attend(q, k, v, spec, scale=SCALE),
                                jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, spec.bias)))
  return fn.lower(q, k, v).compile().as_text(), fn(q, k, v)


def _autodiff_reference(q, k, v, spec, *, scale):
  return dense_attention(q, k, v, spec.mask(), spec.bias_logits(), scale=scale)


@pytest.mark.parametrize(
    "kind, kv_heads",
    [("causal", N), ("causal+packing+t5", 2), ("causal+alibi", 1), ("padding+t5", N),
     ("cross", 2)],
)
def test_dense_in_place_equals_xla_autodiff_of_the_reference(kind, kv_heads, monkeypatch):
  spec = _spec(kind)
  keys = spec.key_length
  q, k, v = _normal(B, T, N, H), _normal(B, keys, kv_heads, H), _normal(B, keys, kv_heads, H)
  hlo, (out, grads) = _outputs_and_gradients(spec, q, k, v, dense)
  # Every contraction of the forward and backward is read in place (6 per query chunk).
  chunks = 2 if kind.startswith("causal") else 1
  assert hlo.count(f'custom_call_target="{cpu_gemm.STRIDED_TARGET}"') == 6 * chunks
  monkeypatch.setattr(cpu_gemm, "available", lambda: False)
  _, (want_out, want_grads) = _outputs_and_gradients(spec, q, k, v, _autodiff_reference)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=2e-5)
  empty_BT = ~np.asarray(spec.mask()[:, 0]).any(-1)
  assert empty_BT.any() == (kind != "causal" and kind != "causal+alibi")  # the case is there
  np.testing.assert_array_equal(np.asarray(out)[empty_BT], 0.0)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_dense_in_place_under_a_data_mesh_equals_one_device():
  spec = _spec("causal+packing+t5")
  q, k, v = _normal(B, T, N, H), _normal(B, T, 2, H), _normal(B, T, 2, H)
  _, (want_out, want_grads) = _outputs_and_gradients(spec, q, k, v, dense)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",), axis_types=(AxisType.Auto,))
  rows = NamedSharding(mesh, P("data"))

  def sharded(q, k, v, spec, *, scale):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return dense(q, k, v, spec, scale=scale)

  q, k, v = (jax.device_put(x, rows) for x in (q, k, v))
  hlo, (out, grads) = _outputs_and_gradients(spec, q, k, v, sharded)
  assert cpu_gemm.STRIDED_TARGET in hlo
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dense_on_a_batch_the_mesh_does_not_divide_keeps_xla_layouts():
  """3 rows over 2 devices: no per-device GEMM, the same attention as on one device."""
  spec = AttentionSpec.self_attention(jnp.ones((3, T), jnp.int32), causal=True)
  q, k, v = _normal(3, T, N, H), _normal(3, T, N, H), _normal(3, T, N, H)
  _, (want_out, want_grads) = _outputs_and_gradients(spec, q, k, v, dense)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",), axis_types=(AxisType.Auto,))

  def on_mesh(q, k, v, spec, *, scale):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return dense(q, k, v, spec, scale=scale)

  hlo, (out, grads) = _outputs_and_gradients(spec, q, k, v, on_mesh)
  assert cpu_gemm.STRIDED_TARGET not in hlo
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
