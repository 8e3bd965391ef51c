"""The GPU backends (`cudnn`, and `pallas` without interpret mode) equal `dense` on a GPU.

Skipped off GPU: the CPU suite checks `pallas` numerics in interpret mode
(test_attention_backends.py) and that both backends refuse to run without a GPU.

The reference is `dense` in float32 on the same (upcast) inputs, at highest matmul
precision. cuDNN computes in bfloat16 and Triton's float32 dots in TF32, so outputs and
gradients are compared by relative Frobenius error ‖got − want‖ / ‖want‖, with bounds set
by those precisions (bf16 ~1e-2, TF32 ~1e-3), not by float32 rounding. Lengths are even
but do not divide the kernels' blocks (64/128); cuDNN's odd-length padding has its own case.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.layers.test_attention_models import FAMILIES, _train_losses
from tests.models.variants import VARIANTS
from tx_jax.layers.attention import BACKENDS
from tx_jax.layers.attention.dense import dense
from tx_jax.layers.attention import AttentionSpec
from tx_jax.layers.positions import AlibiBias, RelativeBias, alibi_slopes

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

B, N, H = 2, 4, 64
RNG = np.random.default_rng(0)
TABLE = jnp.asarray(RNG.standard_normal((32, N)), jnp.float32)


def _segments(length, kind):
  if kind == "one":
    return np.ones((B, length), np.int32)
  if kind == "padding":  # row 1 ends with 37 padding tokens
    return np.array([[1] * length, [1] * (length - 37) + [0] * 37], np.int32)
  a, b = length // 3, 2 * length // 3  # packing: three documents, then two and padding
  return np.array(
      [[1] * a + [2] * (b - a) + [3] * (length - b), [1] * a + [2] * (b - a) + [0] * (length - b)],
      np.int32,
  )


def _spec(kind, length, key_length=None, bias=None):
  if kind == "cross":  # decoder document 3 of row 0 has no encoder document: no visible key
    q_seg = _segments(length, "packing")
    k_seg = np.array([[1] * 60 + [2] * (key_length - 60), [1] * 50 + [2] * 50 + [0] * (key_length - 100)])
    return AttentionSpec.cross_attention(jnp.asarray(q_seg), jnp.asarray(k_seg, jnp.int32))
  if kind == "cross+padding":  # one document per row, then padding (cudnn's lengths)
    q_seg = _segments(length, "padding")
    k_seg = np.array([[1] * key_length, [1] * 100 + [0] * (key_length - 100)])
    return AttentionSpec.cross_attention(
        jnp.asarray(q_seg), jnp.asarray(k_seg, jnp.int32), packed=False
    )
  causal = kind.startswith("causal")
  segments = "packing" if "packing" in kind else "padding" if "padding" in kind else "one"
  seg = _segments(length, segments)
  positions = np.array([[int(np.sum(r[:t] == r[t])) for t in range(length)] for r in seg])
  return AttentionSpec.self_attention(
      jnp.asarray(seg),
      jnp.asarray(positions, jnp.int32),
      causal=causal,
      window=48 if "window" in kind else None,
      bias=bias,
      packed="packing" in kind,
  )


def _qkv(length, key_length, num_kv_heads, seed=1):
  rng = np.random.default_rng(seed)
  shapes = [(B, length, N, H), (B, key_length, num_kv_heads, H), (B, key_length, num_kv_heads, H)]
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _out_and_grads(attend, spec, q, k, v, dtype):
  """Output and d/d(q, k, v, bias parameters) of sum(out * w), inputs cast to dtype."""
  w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v, bias):
    out = attend(*(x.astype(dtype) for x in (q, k, v)), spec.replace(bias=bias), scale=H**-0.5)
    return jnp.sum(out.astype(jnp.float32) * w), out

  with jax.default_matmul_precision("highest"):
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, spec.bias
    )
  return [out] + jax.tree.leaves(grads)


def _assert_close(attend, spec, q, k, v, dtype, bound):
  got = _out_and_grads(attend, spec, q, k, v, dtype)
  want = _out_and_grads(dense, spec, q, k, v, jnp.float32)
  names = ["out", "dq", "dk", "dv"] + ["dbias"] * (len(want) - 4)
  for name, g, w in zip(names, got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g)), name
    error = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert error < bound, f"{name}: relative error {error:.2e} >= {bound}"


CUDNN_CASES = [  # (mask kind, K/V heads, bias): every unpacked mask kind and head layout
    ("none", N, None),
    ("causal", 1, None),
    ("padding", 2, None),
    ("causal+padding", N, None),
    ("causal+window", 1, None),
    ("cross+padding", 2, None),
    ("causal", N, "t5"),
    ("causal+padding", 2, "alibi"),
]


def _bias(name, causal):
  if name == "t5":
    return RelativeBias(TABLE, max_distance=128, bidirectional=not causal)
  return AlibiBias(jnp.asarray(alibi_slopes(N))) if name == "alibi" else None


# Every case at T = 200; two of them (packing + GQA, and a bias whose gradient is checked)
# again at T = 201, which `cudnn` pads to even with a bias. A GPU session is short: ~5 min.
CUDNN_LENGTHS = [case + (200,) for case in CUDNN_CASES] + [
    ("causal+padding", 2, None, 201),
    ("causal", N, "t5", 201),
]


@pytest.mark.parametrize("kind,num_kv_heads,bias,length", CUDNN_LENGTHS)
def test_cudnn_equals_dense(kind, num_kv_heads, bias, length):
  key_length = 136 if kind.startswith("cross") else length
  spec = _spec(kind, length, key_length, _bias(bias, kind.startswith("causal")))
  q, k, v = _qkv(length, key_length, num_kv_heads)
  _assert_close(BACKENDS["cudnn"], spec, q, k, v, jnp.bfloat16, bound=2e-2)


@pytest.mark.parametrize(
    "kind,num_kv_heads", [("none", N), ("causal", 1), ("padding", 2), ("causal+packing", N)]
)
def test_pallas_equals_dense(kind, num_kv_heads):
  pytest.importorskip("jax.experimental.pallas.ops.gpu.attention")  # gone in jax 0.12.1
  spec = _spec(kind, 200)
  q, k, v = _qkv(200, 200, num_kv_heads)
  _assert_close(BACKENDS["pallas"], spec, q, k, v, jnp.float32, bound=5e-3)


# cuDNN: every family (bf16 both ways). Pallas has no bias and no cross-attention: the
# families it can run, in float32.
@pytest.mark.parametrize(
    "backend,name,dtype",
    [("cudnn", f, "bfloat16") for f in FAMILIES]
    + [("pallas", f, "float32") for f in ("gpt2", "llama", "bert")],
)
def test_gpu_backend_trains_like_dense(backend, name, dtype):
  if backend == "pallas":
    pytest.importorskip("jax.experimental.pallas.ops.gpu.attention")  # gone in jax 0.12.1
  # cuDNN takes padding as lengths: its models get one document per row (packed_inputs=False).
  config = dataclasses.replace(VARIANTS[name], dtype=dtype, packed_inputs=backend != "cudnn")
  if config.head_dim % 8:  # cuDNN takes head dims that are multiples of 8 (T5's test has 12)
    config = dataclasses.replace(config, head_dim=16)
  with jax.default_matmul_precision("highest"):
    want = _train_losses(dataclasses.replace(config, attention_backend="dense"))
    got = _train_losses(dataclasses.replace(config, attention_backend=backend))
  assert np.all(np.isfinite(want)) and want[-1] < want[0]
  np.testing.assert_allclose(got, want, rtol=3e-2 if dtype == "bfloat16" else 5e-3)
