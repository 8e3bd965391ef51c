"""float32 matrix products on CPU through MKL's sgemm, called from XLA as an FFI custom call.

XLA:CPU's dots run below MKL's speed at a train step's shapes, and torch, which the CPU
benchmarks compare against, uses MKL. The `cpu` kernels (`tx_jax.cpu`) use this module
where it applies; the model code never does.

- `gemm.cc` is a C++ XLA FFI handler: C = op(A)·op(B), cut into row or column blocks over
  XLA's own intra-op thread pool, each block one single-threaded sgemm.
- It is compiled on first use with the machine's C++ compiler, against the FFI headers of
  the installed jaxlib, into `$XDG_CACHE_HOME/tx_jax/cpu_gemm/` (once per jaxlib).
- MKL comes from the optional `mkl` wheel (`pip install -e ".[cpu-mkl]"`). Its runtime is
  loaded with the sequential threading layer, so the handler alone decides the threads.
- `project` gives the handler autodiff (a custom VJP of three GEMMs) and sharding: under a
  mesh that splits the batch (data, fsdp) each device multiplies its own rows (`shard_map`).
- `einsum.py` builds attention's batched products on the same handler, and on a second one
  that reads its operands in place (`TxJaxCpuStridedGemm`).

Where it does not apply, XLA's dot stays: other dtypes, accelerators, tensor or sequence
parallel meshes, a batch the mesh does not divide, a decoding step's few rows. Where MKL or
a compiler is missing, tx_jax warns once and uses XLA's dot.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.metadata
import logging
import math
import os
import pathlib
import shutil
import site
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

Array = jnp.ndarray

TARGET = "tx_jax_cpu_gemm"
STRIDED_TARGET = "tx_jax_cpu_strided_gemm"
_SOURCE = pathlib.Path(__file__).with_name("gemm.cc")
_BATCH_AXES = ("data", "fsdp")  # tx_jax.sharding.BATCH_AXES (which imports this package)
_MKL_THREADING_SEQUENTIAL = 1  # mkl_service.h's MKL_THREADING_SEQUENTIAL
# Fewer rows than this per device stay with XLA's dot: a decoding step's few rows are a
# matrix-vector product, which XLA fuses with its neighbours and the custom call cannot.
MIN_ROWS = 128

log = logging.getLogger(__name__)


def applies(x: Array, kernel: Array) -> bool:
  """Whether a product of x and kernel runs through MKL here (decided at trace time)."""
  if x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
    return False
  return jax.default_backend() == "cpu" and available()


def available() -> bool:
  """True once the handler is built, MKL loaded and the FFI target registered."""
  reason = _load()
  if reason is None:
    return True
  _warn_unavailable(reason)
  return False


@functools.cache
def _warn_unavailable(reason: str) -> None:
  log.warning("tx_jax: model.kernels='cpu' multiplies with XLA's dot, not MKL (%s)", reason)


@functools.cache
def _load() -> str | None:
  """Builds (or finds) the handler, loads MKL, registers the target; the reason if it can't."""
  mkl = _mkl_runtime()
  if mkl is None:
    return "the mkl package is not installed: pip install -e '.[cpu-mkl]'"
  try:
    library = ctypes.CDLL(str(_built_handler()))
    mkl_rt = ctypes.CDLL(mkl)
  except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
    return f"{type(error).__name__}: {error}"
  # Sequential MKL: the handler splits each GEMM over XLA's pool itself. This must come
  # before any other MKL call in this process.
  mkl_rt.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
  mkl_rt.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
  library.tx_jax_cpu_gemm_set_sgemm.argtypes = [ctypes.c_void_p]
  library.tx_jax_cpu_gemm_set_sgemm(ctypes.cast(mkl_rt.cblas_sgemm, ctypes.c_void_p))
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.TxJaxCpuGemm), platform="cpu")
  jax.ffi.register_ffi_target(
      STRIDED_TARGET, jax.ffi.pycapsule(library.TxJaxCpuStridedGemm), platform="cpu"
  )
  _load.libraries = (library, mkl_rt)  # kept alive with the process
  return None


def _mkl_runtime() -> str | None:
  """libmkl_rt from the `mkl` wheel, which installs it into the environment's lib/ (or the
  user base's, after `pip install --user`)."""
  for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, site.getuserbase())):
    found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    if found:
      return found[0]
  return None


def _cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "tx_jax" / "cpu_gemm"


def _built_handler() -> pathlib.Path:
  """The compiled handler, built once per source and jaxlib; concurrent builders are safe."""
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    raise FileNotFoundError("no C++ compiler (c++, g++ or $CXX) to build the GEMM handler")
  key = hashlib.sha256(_SOURCE.read_bytes() + jax.ffi.include_dir().encode())
  key.update(f"{importlib.metadata.version('jaxlib')} {compiler}".encode())
  target = _cache_dir() / f"cpu_gemm-{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
    built = pathlib.Path(scratch) / target.name
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(built)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    os.replace(built, target)  # atomic: a concurrent build replaces it with the same bytes
  return target


def gemm(a: Array, b: Array, *, trans_a: bool = False, trans_b: bool = False) -> Array:
  """op(a) · op(b) for float32 matrices, or batches of them ([batch, ., .]), through MKL."""
  m = a.shape[-1] if trans_a else a.shape[-2]
  n = b.shape[-2] if trans_b else b.shape[-1]
  # Under vmap (a vmapped model), one call per example: the handler takes 2-D or 3-D operands.
  call = jax.ffi.ffi_call(
      TARGET, jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), jnp.float32), vmap_method="sequential"
  )
  return call(a, b, trans_a=np.bool_(trans_a), trans_b=np.bool_(trans_b))


def batch_axes(x: Array, in_dims: int) -> tuple[str, ...] | None:
  """The mesh axes that split x's leading (batch) dim; None where `project` can't apply.

  Under no mesh, or one of a single device: (). A tensor or sequence axis larger than 1
  splits kernels or lengths, which a per-device GEMM does not model: None (XLA's dot), as
  for fewer than MIN_ROWS rows per device.
  """
  found = batch_split()
  if found is None:
    return None
  split, devices = found
  rows = math.prod(x.shape[: x.ndim - in_dims])
  if x.ndim < 2 or x.shape[0] % devices or rows // devices < MIN_ROWS:
    return None
  return split


def batch_split() -> tuple[tuple[str, ...], int] | None:
  """The current mesh's axes that split the batch and their device count; ((), 1) under no
  mesh; None when a tensor or sequence axis splits anything else."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), 1
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  if any(size > 1 for name, size in sizes.items() if name not in _BATCH_AXES):
    return None
  split = tuple(name for name in _BATCH_AXES if sizes.get(name, 1) > 1)
  return split, math.prod(sizes[name] for name in split)


def project(
    x: Array, kernel: Array, in_dims: int, axes: tuple[str, ...], transposed: bool = False
) -> Array:
  """x [*batch, *in] · kernel [*in, *out] -> [*batch, *out] through MKL; axes: `batch_axes`.

  transposed: the kernel is stored [*out, *in] (a tied embedding [V, D]) and read so, in the
  forward and the backward, and its gradient comes out [*out, *in]: no transposed copy.
  """
  return _project(x, kernel, in_dims, axes, transposed)


def _flat_sizes(kernel: Array, in_dims: int, transposed: bool = False) -> tuple[int, int]:
  """(k, n) of the kernel as a matrix [k, n] (stored [n, k] when transposed)."""
  if transposed:
    return math.prod(kernel.shape[kernel.ndim - in_dims :]), math.prod(kernel.shape[:-in_dims])
  return math.prod(kernel.shape[:in_dims]), math.prod(kernel.shape[in_dims:])


def per_device(fn, axes: tuple[str, ...], in_specs, out_specs):
  """fn on each device's rows when `axes` split the batch; fn itself otherwise."""
  if not axes:
    return fn
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes),
                       check_vma=False)


def _forward(x: Array, kernel: Array, in_dims: int, axes: tuple[str, ...], transposed: bool):
  def local(x, kernel):
    k, n = _flat_sizes(kernel, in_dims, transposed)
    matrix = kernel.reshape((n, k) if transposed else (k, n))
    y = gemm(x.reshape(-1, k), matrix, trans_b=transposed)
    out_shape = kernel.shape[: kernel.ndim - in_dims] if transposed else kernel.shape[in_dims:]
    return y.reshape(x.shape[: x.ndim - in_dims] + out_shape)

  rows = PartitionSpec(axes)
  return per_device(local, axes, (rows, PartitionSpec()), rows)(x, kernel)


_project = jax.custom_vjp(_forward, nondiff_argnums=(2, 3, 4))


def _project_fwd(x, kernel, in_dims, axes, transposed):
  return _forward(x, kernel, in_dims, axes, transposed), (x, kernel)


def _project_bwd(in_dims, axes, transposed, residuals, dy):
  """dx = dy · kernelᵀ on each device; dkernel = Σ_devices xᵀ · dy (dyᵀ · x, transposed)."""
  x, kernel = residuals

  def local(x, kernel, dy):
    k, n = _flat_sizes(kernel, in_dims, transposed)
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    if transposed:
      dx = gemm(dy2, kernel.reshape(n, k))
      dkernel = gemm(dy2, x2, trans_a=True)
    else:
      dx = gemm(dy2, kernel.reshape(k, n), trans_b=True)
      dkernel = gemm(x2, dy2, trans_a=True)
    dkernel = dkernel.reshape(kernel.shape)
    if axes:
      dkernel = jax.lax.psum(dkernel, axes)
    return dx.reshape(x.shape), dkernel

  rows = PartitionSpec(axes)
  in_specs, out_specs = (rows, PartitionSpec(), rows), (rows, PartitionSpec())
  return per_device(local, axes, in_specs, out_specs)(x, kernel, dy)


_project.defvjp(_project_fwd, _project_bwd)
