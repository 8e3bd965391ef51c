"""Attention's batched products through MKL (tx_jax/layers/cpu_einsum.py): `einsum`, whose
operands are laid out first, and `in_place_einsum`, read where they lie by the strided
handler, against jnp.einsum and numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cpu import mkl
from tx_jax.cpu import einsum as cpu_einsum
from tx_jax.cpu import gemm as cpu_gemm


pytestmark = mkl.requires_mkl

RNG = np.random.default_rng(0)


def _normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


# Attention's contractions, with operands laid out as the backends pass them.
EINSUMS = [
    ("btkgh,bskh->bkgts", (2, 40, 3, 2, 32), (2, 48, 3, 32)),  # both operands transposed
    ("bkgts,bskh->bkgth", (2, 3, 2, 40, 48), (2, 48, 3, 32)),
    ("bkgth,bkhs->bkgts", (2, 3, 1, 80, 32), (2, 3, 32, 48)),  # already [batch, M, K], [batch, K, N]
    ("bkhgt,bkgts->bkhs", (2, 3, 32, 1, 80), (2, 3, 1, 80, 48)),  # x as [batch, K, M]
    ("bkgts,btkgh->bskh", (2, 3, 2, 40, 48), (2, 40, 3, 2, 32)),
]


@pytest.mark.parametrize("equation, x_shape, y_shape", EINSUMS)
def test_einsum_value_and_gradients_match_jnp_einsum(equation, x_shape, y_shape):
  x = jax.random.normal(jax.random.key(0), x_shape)
  y = jax.random.normal(jax.random.key(1), y_shape)

  def loss(einsum):
    return lambda x, y: jnp.sum(jnp.sin(einsum(equation, x, y)))

  expected = jax.jit(jax.value_and_grad(loss(jnp.einsum), argnums=(0, 1)))(x, y)
  fn = jax.jit(jax.value_and_grad(loss(cpu_einsum.einsum), argnums=(0, 1)))
  assert len(mkl.hlo_calls(fn.lower(x, y).compile().as_text())) == 3  # out, dx, dy
  for a, b in zip(jax.tree.leaves(fn(x, y)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_einsum_under_a_batch_split_mesh_runs_per_device():
  mesh = mkl.mesh(fsdp=2)
  equation, x_shape, y_shape = EINSUMS[1]
  x = jax.random.normal(jax.random.key(0), x_shape)
  y = jax.random.normal(jax.random.key(1), y_shape)
  batch = NamedSharding(mesh, P(("data", "fsdp")))
  x_sharded, y_sharded = jax.device_put(x, batch), jax.device_put(y, batch)

  def fn(x, y):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return cpu_einsum.einsum(equation, x, y)

  compiled = jax.jit(fn).lower(x_sharded, y_sharded).compile()
  (call,) = mkl.hlo_calls(compiled.as_text())
  assert "f32[3,80,32]" in call  # one example of 2 per device: [k, (g t), h]
  np.testing.assert_allclose(
      np.asarray(compiled(x_sharded, y_sharded)), np.asarray(jnp.einsum(equation, x, y)),
      rtol=2e-5, atol=2e-5,
  )


@pytest.mark.parametrize(
    "equation, x_shape, y_shape",
    [
        ("bkgth,bskh->bkgts", (2, 3, 1, 1, 32), (2, 48, 3, 32)),  # one query: a decoding step
        ("ij,jk->ik", (8, 8), (8, 8)),  # under a MFLOP
        ("ij,jk->i", (64, 64), (64, 64)),  # a letter summed away on one side only
        ("ii,ik->ik", (64, 64), (64, 64)),  # a repeated letter
    ],
)
def test_einsum_leaves_what_is_not_a_batched_matrix_product_to_xla(equation, x_shape, y_shape):
  x, y = jnp.ones(x_shape), jnp.ones(y_shape)
  fn = jax.jit(lambda x, y: cpu_einsum.einsum(equation, x, y))
  assert cpu_gemm.TARGET not in fn.lower(x, y).as_text()
  np.testing.assert_allclose(np.asarray(fn(x, y)), np.asarray(jnp.einsum(equation, x, y)))


def _windows_in_numpy(equation, x, y, sizes, starts):
  xs, ys, _ = cpu_einsum._letters(equation)
  extent = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape)), **sizes}

  def window(operand, letters, start):
    return np.asarray(operand)[
        tuple(slice(start.get(c, 0), start.get(c, 0) + extent[c]) for c in letters)
    ]

  return np.einsum(
      equation, window(x, xs, starts[0]).astype(np.float64), window(y, ys, starts[1])
  )


# (equation, batch, x shape, y shape, sizes, starts): a query chunk against a prefix of the
# keys; groups repeating the keys (k has no g); an operand read transposed (p's s rows are
# its columns); a contraction over a query window written [B, S, K, G, H].
IN_PLACE = [
    ("btkgh,bskh->bkgts", "bkg", (2, 96, 2, 3, 16), (2, 96, 2, 16), {"t": 32, "s": 64},
     ({"t": 32}, {})),
    ("bkgts,bskh->btkgh", "bkg", (2, 2, 3, 32, 64), (2, 96, 2, 16), {"s": 64}, ({}, {})),
    ("bkgts,btkgh->bskgh", "bkg", (2, 2, 3, 32, 64), (2, 96, 2, 3, 16), {"t": 32},
     ({}, {"t": 64})),
    ("bij,bjk->bik", "b", (3, 40, 50), (3, 50, 60), {}, ({}, {})),
]


@pytest.mark.parametrize("equation, batch, x_shape, y_shape, sizes, starts", IN_PLACE)
def test_in_place_einsum_matches_numpy_and_copies_nothing(
    equation, batch, x_shape, y_shape, sizes, starts
):
  x, y = _normal(*x_shape), _normal(*y_shape)
  fn = jax.jit(
      lambda x, y: cpu_einsum.in_place_einsum(equation, x, y, batch=batch, sizes=sizes,
                                            starts=starts)
  )
  hlo = fn.lower(x, y).compile().as_text()
  assert cpu_gemm.STRIDED_TARGET in hlo
  # The operands go to the call as they are: no slice, transpose or copy before it.
  ops = [line.split("=")[1].split("(")[0] for line in hlo.splitlines() if " = " in line]
  assert not any(op.strip().split()[-1] in ("slice", "transpose", "copy", "fusion")
                 for op in ops), ops
  np.testing.assert_allclose(
      np.asarray(fn(x, y)), _windows_in_numpy(equation, x, y, sizes, starts), rtol=1e-5,
      atol=1e-4,
  )


def test_in_place_einsum_under_a_batch_split_mesh_runs_per_device():
  equation, batch, x_shape, y_shape, sizes, starts = IN_PLACE[0]
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",), axis_types=(AxisType.Auto,))
  x, y = _normal(*x_shape), _normal(*y_shape)
  rows = NamedSharding(mesh, P("data"))

  def fn(x, y):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return cpu_einsum.in_place_einsum(equation, x, y, batch=batch, sizes=sizes, starts=starts)

  compiled = jax.jit(fn).lower(jax.device_put(x, rows), jax.device_put(y, rows)).compile()
  (call,) = mkl.hlo_calls(compiled.as_text(), cpu_gemm.STRIDED_TARGET)
  assert "f32[1,2,3,32,64]" in call  # one example per device
  np.testing.assert_allclose(
      np.asarray(compiled(jax.device_put(x, rows), jax.device_put(y, rows))),
      _windows_in_numpy(equation, x, y, sizes, starts), rtol=1e-5, atol=1e-4,
  )


def test_a_view_outside_its_buffer_is_refused_by_the_handler():
  a, b = _normal(4, 8), _normal(8, 4)
  call = jax.ffi.ffi_call(cpu_gemm.STRIDED_TARGET, jax.ShapeDtypeStruct((4, 4), jnp.float32))
  view = lambda offset: np.array([offset, 0, 0, 0, 8, 0], np.int64)  # noqa: E731
  shape = np.array([1, 1, 1, 4, 4, 8], np.int64)
  c_view = np.array([0, 0, 0, 0, 4, 0], np.int64)
  good = call(a, b, shape=shape, a_view=view(0), b_view=np.array([0, 0, 0, 0, 4, 0], np.int64),
              c_view=c_view)
  np.testing.assert_allclose(np.asarray(good), np.asarray(a) @ np.asarray(b), rtol=1e-5)
  with pytest.raises(Exception, match="a view lies outside its buffer"):
    jax.block_until_ready(call(a, b, shape=shape, a_view=view(1), b_view=view(0), c_view=c_view))
