"""float32 matrix products on CPU through MKL's sgemm, called from XLA as an FFI custom call.

Why: XLA:CPU's dots (YNNPACK) reach 0.75-0.9 of MKL's speed at the shapes of a train step,
and torch, which tx_jax's benchmarks compare against, uses MKL. Measured on a 2-core Xeon
(docs/performance_xeon.md, twenty-third part): the bench config's kernel-gradient GEMMs ran
1.27x faster through MKL, the tied output projection 1.43x, the whole step 1.2x.

How:
- `cpu_gemm.cc` is a C++ XLA FFI handler: C = op(A)·op(B), cut into row or column blocks
  over XLA's own intra-op thread pool, each block one single-threaded sgemm.
- It is compiled on first use with the machine's C++ compiler, against the FFI headers of the
  installed jaxlib, into `$XDG_CACHE_HOME/tx_jax/cpu_gemm/` (~2 s, once per jaxlib).
- MKL comes from the `mkl` wheel, a dependency on Linux x86-64; its runtime library is told to
  run sequentially, so the handler alone decides the threads.
- `project` gives the handler autodiff (a custom VJP of three GEMMs) and sharding: under a
  mesh that splits the batch (data, fsdp) each device multiplies its own rows (`shard_map`),
  and the kernel's gradient is summed over them. `linear.project` calls it.
- `einsum` does the same for batched matrix products: attention's q·kᵀ and p·v and their
  gradients (`blockwise_attention`, `dense_attention`), which YNNPACK ran at ~80 GFLOP/s
  at the bench shape.
- `in_place_einsum` is one batched product whose operands and result stay where they lie:
  the handler reads each matrix through an offset, batch strides and a row stride, so a
  query chunk of [B, T, N, H] is a window of it, not a transposed copy
  (`chunked_attention`, `dense`'s forward and backward; no autodiff of its own).

Where it does not apply, XLA's dot stays: other dtypes, accelerators, tensor or sequence
parallel meshes, a batch the mesh does not divide, a decoding step's few rows. Where MKL or
a compiler is missing, tx_jax warns once and uses XLA's dot everywhere. On CPUs other than
Intel's it is off unless asked for: it was measured on Intel Xeons only.
`TX_JAX_CPU_GEMM=xla` turns it off; `=mkl` turns it on anywhere and makes a missing MKL or
compiler an error.
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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

Array = jnp.ndarray

ENV = "TX_JAX_CPU_GEMM"
SETTINGS = ("auto", "mkl", "xla")  # auto: MKL on Intel CPUs where it is available
TARGET = "tx_jax_cpu_gemm"
STRIDED_TARGET = "tx_jax_cpu_strided_gemm"
_SOURCE = pathlib.Path(__file__).with_name("cpu_gemm.cc")
_BATCH_AXES = ("data", "fsdp")  # tx_jax.sharding.BATCH_AXES (which imports this package)
_MKL_THREADING_SEQUENTIAL = 1  # mkl_service.h's MKL_THREADING_SEQUENTIAL
# Fewer rows than this per device stay with XLA's dot: a decoding step's few rows are a
# matrix-vector product, which XLA fuses with its neighbours and the custom call cannot
# (cached decoding at batch 1 ran 4,775 tok/s with XLA's dot, 3,380 through MKL).
MIN_ROWS = 128

log = logging.getLogger(__name__)


def setting() -> str:
  value = os.environ.get(ENV, "auto").strip().lower() or "auto"
  if value not in SETTINGS:
    raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(SETTINGS)}")
  return value


def applies(x: Array, kernel: Array) -> bool:
  """Whether `project(x, kernel, ...)` should run through MKL here (decided at trace time)."""
  if x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
    return False
  chosen = setting()
  if jax.default_backend() != "cpu" or chosen == "xla":
    return False
  # Measured on Intel Xeons only: on other CPUs MKL's speed is unknown here, so `auto`
  # keeps XLA's dot there and `mkl` opts in.
  if chosen == "auto" and cpu_vendor() != "GenuineIntel":
    return False
  return available()


@functools.cache
def cpu_vendor() -> str:
  """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...); '' where there is none."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
      for line in cpuinfo:
        if line.startswith("vendor_id"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def available() -> bool:
  """True once the handler is built, MKL loaded and the FFI target registered."""
  reason = _load()
  if reason is None:
    return True
  if setting() == "mkl":
    raise RuntimeError(f"{ENV}=mkl, but MKL's GEMM is unavailable: {reason}")
  _warn_unavailable(reason)
  return False


@functools.cache
def _warn_unavailable(reason: str) -> None:
  log.warning("tx_jax: matrix products use XLA's dot on CPU, not MKL (%s). %s=xla hides this.",
              reason, ENV)


@functools.cache
def _load() -> str | None:
  """Builds (or finds) the handler, loads MKL, registers the target; the reason if it can't."""
  mkl = _mkl_runtime()
  if mkl is None:
    return "the mkl package is not installed (pip install mkl)"
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
  found = _batch_split()
  if found is None:
    return None
  split, devices = found
  rows = math.prod(x.shape[: x.ndim - in_dims])
  if x.ndim < 2 or x.shape[0] % devices or rows // devices < MIN_ROWS:
    return None
  return split


def _batch_split() -> tuple[tuple[str, ...], int] | None:
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


def _per_device(fn, axes: tuple[str, ...], in_specs, out_specs):
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
  return _per_device(local, axes, (rows, PartitionSpec()), rows)(x, kernel)


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
  return _per_device(local, axes, in_specs, out_specs)(x, kernel, dy)


_project.defvjp(_project_fwd, _project_bwd)


# ----------------------------------------------------------------------------- einsum

# A contraction smaller than this in any of M, N, K, or in FLOPs, stays with XLA's dot: a
# matrix-vector product (a decoding step's attention) fuses with its neighbours there.
MIN_EINSUM_DIM = 16
MIN_EINSUM_FLOPS = 1 << 20


class _Plan(NamedTuple):
  equation: str
  axes: tuple[str, ...]  # mesh axes that split the shared leading (batch) letter


def einsum(equation: str, x: Array, y: Array, *, preferred_element_type=None) -> Array:
  """`jnp.einsum` of two operands, as MKL's GEMMs over the batch letters where that applies.

  Applies to float32 on CPU when the equation is a batched matrix product (every letter
  kept, or shared by both operands, none repeated) of at least MIN_EINSUM_DIM in each of
  M, N and K. The operands are transposed to [batch, M, K] and [batch, K, N], or passed
  transposed to the GEMM when they already are; under a mesh that splits the batch, the
  leading letter of both operands and the output must be that batch. Elsewhere, jnp.einsum.
  """
  plan = _einsum_plan(equation, x, y)
  if plan is None:
    return jnp.einsum(equation, x, y, preferred_element_type=preferred_element_type)
  return _einsum(x, y, plan)


def _letters(equation: str) -> tuple[str, str, str] | None:
  inputs, arrow, out = equation.replace(" ", "").partition("->")
  x, comma, y = inputs.partition(",")
  if not arrow or not comma or not (x + y + out).isalpha():
    return None
  if any(len(set(s)) != len(s) for s in (x, y, out)):
    return None
  if set(out) - set(x) - set(y) or set(x) - set(out) - set(y) or set(y) - set(out) - set(x):
    return None
  return x, y, out


def _roles(x: str, y: str, out: str) -> tuple[str, str, str, str]:
  batch = "".join(c for c in out if c in x and c in y)
  m = "".join(c for c in x if c in out and c not in y)
  n = "".join(c for c in y if c in out and c not in x)
  k = "".join(c for c in x if c in y and c not in out)
  return batch, m, n, k


def _einsum_plan(equation: str, x: Array, y: Array) -> _Plan | None:
  letters = _letters(equation)
  if letters is None or not applies(x, y):
    return None
  xs, ys, out = letters
  batch, m, n, k = _roles(xs, ys, out)
  size = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape))}
  dims = [math.prod(size[c] for c in part) for part in (batch, m, n, k)]
  if not (m and n and k) or min(dims[1:]) < MIN_EINSUM_DIM:
    return None
  if 2 * math.prod(dims) < MIN_EINSUM_FLOPS:
    return None
  found = _batch_split()
  if found is None:
    return None
  split, devices = found
  if split and not (xs[0] == ys[0] == out[0] and xs[0] in batch):
    return None
  if size[xs[0]] % devices:
    return None
  return _Plan(equation, split)


def _as_matrices(operand: Array, letters: str, batch: str, first: str, second: str):
  """operand as [batch, first, second], or as [batch, second, first] and True (transposed)."""
  size = dict(zip(letters, operand.shape))
  extent = lambda part: math.prod(size[c] for c in part)  # noqa: E731
  if letters == batch + second + first:
    return operand.reshape(extent(batch), extent(second), extent(first)), True
  if letters != batch + first + second:
    operand = operand.transpose([letters.index(c) for c in batch + first + second])
  return operand.reshape(extent(batch), extent(first), extent(second)), False


def _contract(equation: str, x: Array, y: Array) -> Array:
  xs, ys, out = _letters(equation)
  batch, m, n, k = _roles(xs, ys, out)
  a, trans_a = _as_matrices(x, xs, batch, m, k)
  b, trans_b = _as_matrices(y, ys, batch, k, n)
  size = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape))}
  c = gemm(a, b, trans_a=trans_a, trans_b=trans_b)
  c = c.reshape([size[ch] for ch in batch + m + n])
  return c.transpose([(batch + m + n).index(ch) for ch in out])


def _einsum_per_device(x: Array, y: Array, plan: _Plan) -> Array:
  rows = PartitionSpec(plan.axes)
  fn = functools.partial(_contract, plan.equation)
  return _per_device(fn, plan.axes, (rows, rows), rows)(x, y)


_einsum = jax.custom_vjp(_einsum_per_device, nondiff_argnums=(2,))


def _einsum_fwd(x, y, plan):
  return _einsum_per_device(x, y, plan), (x, y)


def _einsum_bwd(plan, residuals, dout):
  """dx = dout ⋅ y and dy = x ⋅ dout over the letters each lacks: two more contractions."""
  x, y = residuals
  xs, ys, out = _letters(plan.equation)
  dx = _einsum_per_device(dout, y, _Plan(f"{out},{ys}->{xs}", plan.axes))
  dy = _einsum_per_device(x, dout, _Plan(f"{xs},{out}->{ys}", plan.axes))
  return dx, dy


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


# ----------------------------------------------------------------------------- in place


def in_place_applies(x: Array, y: Array) -> bool:
  """Whether `in_place_einsum` reads x and y in place through MKL (else it slices them and
  calls jnp.einsum): float32 on CPU, MKL available, a mesh that splits at most the batch,
  into equal parts of x's leading dim (as `einsum`'s plan asks)."""
  if not applies(x, y):
    return False
  found = _batch_split()
  return found is not None and x.ndim > 0 and x.shape[0] % found[1] == 0


def in_place_einsum(
    equation: str,
    x: Array,
    y: Array,
    *,
    batch: str,
    sizes: dict[str, int] | None = None,
    starts: tuple[dict[str, int], dict[str, int]] | None = None,
) -> Array:
  """One batched matrix product over windows of x and y, read where they lie in memory.

  equation: letters as jnp.einsum's; `batch` names the letters every GEMM of the batch has
  (at most three, leading letter first; an operand without one repeats along it). The
  others, after dropping letters of extent 1, must be one row and one column letter per
  operand (M, K for x; K, N for y), and each operand's or the output's last letter one of
  its two. sizes: {letter: extent} (default: the operands' extents); starts: ({letter:
  start} for x, {letter: start} for y), the windows' corners (a query chunk, a prefix of the
  keys). The output is a new array, laid out as its letters say. No operand or result is
  transposed or sliced by a copy: the GEMMs read and write them in place. Where that does
  not apply (`in_place_applies`), jnp.einsum of the windows.

  Under a mesh that splits the batch, every operand's and the output's leading letter is
  the batch, split per device (`shard_map`); windows apply to the other letters.
  """
  xs, ys, out = _letters(equation)
  extent = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape)), **(sizes or {})}
  x_starts, y_starts = starts or ({}, {})
  for operand, letters, corner in ((x, xs, x_starts), (y, ys, y_starts)):
    for c, dim in zip(letters, operand.shape):
      if not 0 <= corner.get(c, 0) <= corner.get(c, 0) + extent[c] <= dim:
        raise ValueError(f"in_place_einsum {equation!r}: {c} window [{corner.get(c, 0)}, "
                         f"+{extent[c]}) is outside its operand's extent {dim}")
  if not in_place_applies(x, y):
    return jnp.einsum(equation, _window(x, xs, extent, x_starts), _window(y, ys, extent, y_starts))
  split, devices = _batch_split()
  if split and not (xs[0] == ys[0] == out[0] == batch[0] and batch[0] not in (sizes or {})):
    raise ValueError(f"in_place_einsum {equation!r}: the mesh splits the leading letter, "
                     f"which must be the batch {batch!r} of every operand")
  local = {**extent, batch[0]: extent[batch[0]] // devices} if split else extent
  fn = functools.partial(_in_place, xs, ys, out, batch, local, x_starts, y_starts)
  rows = PartitionSpec(split)
  return _per_device(fn, split, (rows, rows), rows)(x, y)


def _window(operand: Array, letters: str, extent: dict, starts: dict) -> Array:
  begin = [starts.get(c, 0) for c in letters]
  return jax.lax.slice(operand, begin, [b + extent[c] for b, c in zip(begin, letters)])


def _in_place(xs, ys, out, batch, extent, x_starts, y_starts, x, y):
  """The strided handler's call for one device's operands (see `in_place_einsum`)."""
  kept = lambda letters: {c for c in letters if c not in batch and extent[c] > 1}  # noqa: E731
  rx, ry, ro = kept(xs), kept(ys), kept(out)
  m, n, k = rx & ro, ry & ro, rx & ry
  if (len(batch) > 3 or set(batch) - set(out) or max(len(m), len(n), len(k)) > 1
      or rx != m | k or ry != k | n or ro != m | n or not k):
    raise ValueError(f"in_place_einsum: {xs},{ys}->{out} over batch {batch!r} is not one GEMM")
  m, n, k = (next(iter(role), None) for role in (m, n, k))
  out_shape = tuple(extent[c] for c in out)
  c_view = _view(out, out_shape, {}, batch, m, n)
  if c_view[-1]:
    raise ValueError(f"in_place_einsum: {out!r} must end in its column letter {n!r}")
  size = lambda c: 1 if c is None else extent[c]  # noqa: E731
  shape = [extent[c] for c in batch] + [1] * (3 - len(batch)) + [size(m), size(n), size(k)]
  call = jax.ffi.ffi_call(
      STRIDED_TARGET, jax.ShapeDtypeStruct(out_shape, jnp.float32), vmap_method="sequential"
  )
  return call(
      x,
      y,
      shape=np.array(shape, np.int64),
      a_view=np.array(_view(xs, x.shape, x_starts, batch, m, k), np.int64),
      b_view=np.array(_view(ys, y.shape, y_starts, batch, k, n), np.int64),
      c_view=np.array(c_view, np.int64),
  )


def _view(letters: str, shape, starts: dict, batch: str, row: str | None, col: str | None):
  """[offset, batch strides x3, ld, trans] of the [row, col] matrices of a row-major array."""
  stride = {c: math.prod(shape[i + 1 :]) for i, c in enumerate(letters)}
  offset = sum(starts.get(c, 0) * stride[c] for c in letters)
  batch_strides = [stride.get(c, 0) for c in batch] + [0] * (3 - len(batch))
  row_stride, col_stride = stride.get(row), stride.get(col, 1)
  if col_stride == 1:  # rows ld apart (a lone row: ld is any width that holds it)
    return [offset, *batch_strides, row_stride if row else max(shape[-1], 1), 0]
  if row_stride in (1, None):
    return [offset, *batch_strides, col_stride, 1]
  raise ValueError(f"in_place_einsum: neither {row!r} nor {col!r} is {letters!r}'s last letter")
