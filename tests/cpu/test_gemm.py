"""MKL's GEMM as an XLA custom call (tx_jax/cpu/gemm.py) against numpy and XLA's dot."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cpu import mkl
from tx_jax.cpu import gemm as cpu_gemm
from tx_jax.cpu import projection


pytestmark = mkl.requires_mkl


# (m, k, n): one element; empty output; an empty contraction; a block split that does not
# divide; wide outputs split by columns; the bench config's up projection.
SHAPES = [(1, 1, 1), (0, 3, 4), (5, 0, 7), (301, 67, 129), (40, 300, 1001), (2048, 512, 2048)]


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True)])
def test_gemm_matches_numpy_in_float64(m, k, n, trans_a, trans_b):
  rng = np.random.default_rng(m + k + n)
  a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
  b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
  got = jax.jit(lambda a, b: cpu_gemm.gemm(a, b, trans_a=trans_a, trans_b=trans_b))(a, b)
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  expected = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  # float32 accumulation over k terms of unit variance: error grows like sqrt(k).
  np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=2e-6 * max(k, 1) ** 0.5 * 4)


def _loss(project_fn, in_dims):
  return lambda x, w: jnp.sum(jnp.sin(project_fn(x, w, in_dims)))


def _xla_project(x, w, in_dims):
  return projection._contract(x, w, in_dims)


@pytest.mark.parametrize(
    "x_shape, w_shape, in_dims",
    [((4, 37, 6), (6, 33), 1), ((4, 37, 6), (6, 3, 5), 1), ((4, 37, 3, 2), (3, 2, 9), 2)],
)
def test_project_value_and_gradients_match_xla_dot(x_shape, w_shape, in_dims):
  x = jax.random.normal(jax.random.key(0), x_shape)
  w = jax.random.normal(jax.random.key(1), w_shape)
  expected = jax.jit(jax.value_and_grad(_loss(_xla_project, in_dims), argnums=(0, 1)))(x, w)
  fn = jax.value_and_grad(_loss(projection.project, in_dims), argnums=(0, 1))
  got = jax.jit(fn)(x, w)
  assert len(mkl.hlo_calls(jax.jit(fn).lower(x, w).compile().as_text())) == 3  # y, dx, dkernel
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("under_mesh", [False, True])
def test_a_kernel_stored_transposed_is_read_in_place_forward_and_backward(under_mesh):
  """A tied embedding [V, D] as the kernel [D, V]: no transpose of it or of its gradient."""
  x = jax.random.normal(jax.random.key(0), (4, 64, 6))  # 128 rows per device on 2
  table = jax.random.normal(jax.random.key(1), (33, 6))
  expected = jax.jit(jax.value_and_grad(_loss(_xla_project, 1), argnums=(0, 1)))(x, table.T)
  mesh = mkl.mesh(data=2)

  def step(x, table):
    loss = lambda x, table: jnp.sum(jnp.sin(projection.project(x, table, 1, kernel_transposed=True)))  # noqa: E731
    if not under_mesh:
      return jax.value_and_grad(loss, argnums=(0, 1))(x, table)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.value_and_grad(loss, argnums=(0, 1))(x, table)

  if under_mesh:
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
  compiled = jax.jit(step).lower(x, table).compile()
  assert len(mkl.hlo_calls(compiled.as_text())) == 3
  assert " transpose(" not in compiled.as_text() and "transpose_" not in compiled.as_text()
  value, (dx, dtable) = compiled(x, table)
  want_value, (want_dx, want_dkernel) = expected
  np.testing.assert_allclose(np.asarray(value), np.asarray(want_value), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dtable), np.asarray(want_dkernel).T, rtol=1e-5, atol=1e-5)


def test_project_under_a_batch_split_mesh_runs_per_device_and_sums_the_kernel_gradient():
  """fsdp=2, data=2: each device multiplies its quarter of the rows; dkernel is all-reduced."""
  mesh = mkl.mesh(data=2, fsdp=2)
  x = jax.random.normal(jax.random.key(0), (8, 64, 6))
  w = jax.random.normal(jax.random.key(1), (6, 10))
  expected = jax.jit(jax.value_and_grad(_loss(_xla_project, 1), argnums=(0, 1)))(x, w)

  def step(x, w):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.value_and_grad(_loss(projection.project, 1), argnums=(0, 1))(x, w)

  x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
  w_sharded = jax.device_put(w, NamedSharding(mesh, P("fsdp")))
  compiled = jax.jit(step).lower(x_sharded, w_sharded).compile()
  calls = mkl.hlo_calls(compiled.as_text())
  assert len(calls) == 3
  # 8 x 64 = 512 rows over 4 devices: every call sees x, or dx, as 128 rows of 6.
  assert all("f32[128,6]" in line and "f32[512," not in line for line in calls)
  got = compiled(x_sharded, w_sharded)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_meshes_and_indivisible_batches_keep_xla_dot():
  x, w = jnp.ones((3, 128, 6)), jnp.ones((6, 8))
  for mesh in (mkl.mesh(tensor=2), mkl.mesh(fsdp=2)):  # a split kernel; 3 rows over 2 devices
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert cpu_gemm.batch_axes(x, 1) is None
      text = jax.jit(lambda x, w: projection.project(x, w, 1)).lower(x, w).as_text()
    assert cpu_gemm.TARGET not in text


def test_few_rows_other_dtypes_and_the_xla_setting_keep_xla_dot(monkeypatch):
  x, w = jnp.ones((2, 64, 6)), jnp.ones((6, 8))
  lower = lambda x, w: jax.jit(lambda x, w: projection.project(x, w, 1)).lower(x, w).as_text()  # noqa: E731
  assert cpu_gemm.TARGET in lower(x, w)
  assert cpu_gemm.TARGET not in lower(x[:1, :-1], w)  # 63 rows: a decoding step's size
  assert cpu_gemm.TARGET not in lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  monkeypatch.setattr(cpu_gemm, "available", lambda: False)
  assert cpu_gemm.TARGET not in lower(x, w)


def test_project_under_vmap_equals_the_unbatched_projection():
  x = jax.random.normal(jax.random.key(0), (3, 130, 6))
  w = jax.random.normal(jax.random.key(1), (6, 8))
  fn = jax.jit(jax.vmap(lambda x: projection.project(x, w, 1)))
  assert cpu_gemm.TARGET in fn.lower(x).as_text()
  got = fn(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)


_WITHOUT_COMPILER = """
import logging, jax, jax.numpy as jnp
logging.basicConfig(level=logging.WARNING)
from tx_jax.cpu import projection
x, w = jnp.ones((200, 3)), jnp.ones((3, 4))
print(float(jax.jit(lambda x, w: projection.project(x, w, 1))(x, w).sum()) / 100)
"""


def test_without_a_compiler_the_cpu_kernels_fall_back_to_xla_with_a_warning(tmp_path):
  env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
         "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
  run = subprocess.run([sys.executable, "-c", _WITHOUT_COMPILER], env=env, capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == "24.0"
  assert "model.kernels='cpu' multiplies with XLA's dot, not MKL" in run.stderr


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_batched_gemm_matches_numpy(batch, trans_a, trans_b):
  rng = np.random.default_rng(batch)
  m, k, n = 37, 50, 29
  a = rng.standard_normal((batch,) + ((k, m) if trans_a else (m, k)), dtype=np.float32)
  b = rng.standard_normal((batch,) + ((n, k) if trans_b else (k, n)), dtype=np.float32)
  got = jax.jit(lambda a, b: cpu_gemm.gemm(a, b, trans_a=trans_a, trans_b=trans_b))(a, b)
  a64 = np.swapaxes(a, 1, 2) if trans_a else a
  b64 = np.swapaxes(b, 1, 2) if trans_b else b
  np.testing.assert_allclose(np.asarray(got), a64.astype(np.float64) @ b64, rtol=0, atol=1e-4)
