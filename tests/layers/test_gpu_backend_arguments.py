"""What each GPU backend hands its kernel, checked on CPU: `cudnn` passes sequence lengths,
`is_causal` and a left window to jax.nn.dot_product_attention and never a [T, S] mask;
`pallas` passes segment ids to the Pallas mha. The kernel calls are replaced by recorders
that check the arguments and then compute with JAX's XLA implementation (cudnn) or the
Pallas kernel in interpret mode (pallas), so the results are also compared with `dense`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.layers.attention import BACKENDS, AttentionSpec
from tx_jax.layers.attention.dense import dense
from tx_jax.layers.positions import RelativeBias

B, T, S, N, H = 2, 11, 9, 4, 8
SCALE = 0.35
WINDOW = 3
TABLE = jnp.asarray(np.random.default_rng(0).standard_normal((8, N)), jnp.float32)
PADDED = jnp.array([[1] * T, [1] * (T - 4) + [0] * 4], jnp.int32)  # row 1 ends with padding
PACKED = jnp.array([[1] * 4 + [2] * (T - 4), [1] * 5 + [0] * (T - 5)], jnp.int32)


def _qkv(num_kv_heads, key_length=T, dtype=jnp.bfloat16):
  rng = np.random.default_rng(1)
  shapes = [(B, T, N, H), (B, key_length, num_kv_heads, H), (B, key_length, num_kv_heads, H)]
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


@pytest.fixture
def on_gpu(monkeypatch):
  """The backends' platform check sees a GPU; the kernels still run on the CPU."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture
def cudnn_calls(monkeypatch, on_gpu):
  """Records every jax.nn.dot_product_attention call and computes it with implementation='xla'."""
  del on_gpu
  calls, real = [], jax.nn.dot_product_attention

  def record(query, key, value, bias=None, mask=None, **kwargs):
    calls.append(dict(query=query, key=key, bias=bias, mask=mask, **kwargs))
    assert kwargs.pop("implementation") == "cudnn"
    return real(query, key, value, bias, mask, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", record)
  return calls


def _out_and_grads(attend, spec, q, k, v):
  """Output and d/d(q, k, v) of sum(out * w), in float32 from the same inputs."""
  w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v):
    out = attend(q, k, v, spec, scale=SCALE)
    return jnp.sum(out.astype(jnp.float32) * w), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return [out, *grads]


def _assert_close_to_dense(attend, spec, q, k, v, bound):
  """Relative Frobenius error against `dense` on the same inputs upcast to float32."""
  got = _out_and_grads(attend, spec, q, k, v)
  want = _out_and_grads(dense, spec, *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    error = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert error < bound, f"{name}: relative error {error:.2e} >= {bound}"


CUDNN_CASES = {  # name: (spec, K/V heads, key length)
    "none": (
        AttentionSpec.self_attention(jnp.ones((B, T), jnp.int32), causal=False, packed=False),
        N,
        T,
    ),
    "causal+padding": (AttentionSpec.self_attention(PADDED, causal=True, packed=False), 2, T),
    "causal+window": (
        AttentionSpec.self_attention(PADDED, causal=True, window=WINDOW, packed=False),
        1,
        T,
    ),
    "padding": (AttentionSpec.self_attention(PADDED, causal=False, packed=False), 2, T),
    "cross+padding": (
        AttentionSpec.cross_attention(
            PADDED, jnp.array([[1] * S, [1] * 6 + [0] * 3], jnp.int32), packed=False
        ),
        2,
        S,
    ),
    "causal+t5": (
        AttentionSpec.self_attention(
            PADDED,
            causal=True,
            bias=RelativeBias(TABLE, max_distance=16, bidirectional=False),
            packed=False,
        ),
        N,
        T,
    ),
}


@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_passes_lengths_not_a_mask(name, cudnn_calls):
  spec, num_kv_heads, key_length = CUDNN_CASES[name]
  q, k, v = _qkv(num_kv_heads, key_length)
  _assert_close_to_dense(BACKENDS["cudnn"], spec, q, k, v, bound=2e-2)
  call = cudnn_calls[0]
  assert call["mask"] is None
  np.testing.assert_array_equal(call["query_seq_lengths"], np.sum(spec.query_segment_ids != 0, 1))
  np.testing.assert_array_equal(call["key_value_seq_lengths"], np.sum(spec.key_segment_ids != 0, 1))
  assert call["query_seq_lengths"].dtype == jnp.int32
  assert call["is_causal"] == spec.causal
  assert call.get("local_window_size") == ((WINDOW - 1, 0) if spec.window else None)
  assert call["key"].shape[2] == num_kv_heads  # GQA: K/V heads are not repeated
  if spec.bias is None:
    assert call["bias"] is None and call["query"].shape[1] == T  # no padding to even
  else:  # the bias is [B, N, T, S] itself; lengths are padded to even for cuDNN's training
    assert call["bias"].shape == (B, N, T + 1, key_length + 1)


@pytest.mark.parametrize(
    "spec,what",
    [
        (AttentionSpec.self_attention(PACKED, causal=True), "'pallas'"),
        (AttentionSpec.self_attention(PADDED, causal=False, window=WINDOW, packed=False), "left"),
        (
            AttentionSpec.self_attention(
                PADDED, causal=True, explicit_mask=jnp.ones((1, 1, T, T), bool), packed=False
            ),
            "explicit_mask",
        ),
        (
            AttentionSpec.self_attention(
                PADDED, causal=True, index_BT=jnp.zeros((B, T), jnp.int32), packed=False
            ),
            "array position",
        ),
    ],
)
def test_cudnn_refuses_what_needs_a_mask(spec, what, cudnn_calls):
  with pytest.raises(ValueError, match=what):
    BACKENDS["cudnn"](*_qkv(N), spec, scale=SCALE)
  assert not cudnn_calls


def test_unspecified_specs_are_packed():
  """A spec that promises nothing is treated as packed, so `cudnn` refuses it."""
  assert AttentionSpec.self_attention(PADDED, causal=True).packed
  assert AttentionSpec.cross_attention(PADDED, PADDED).packed
  unpacked = AttentionSpec.self_attention(PADDED, causal=True, packed=False)
  assert not unpacked.queries(2, 4).keys(1, 5).padded(8, 8).packed
  assert unpacked.with_keys(PADDED, PADDED, PADDED).packed


def test_pallas_passes_segment_ids_and_repeated_kv_heads(monkeypatch, on_gpu):
  """The Triton mha takes as many K/V heads as query heads (its K/V BlockSpec indexes by
  query head), so `pallas` repeats them; padding and packing reach it as segment ids."""
  del on_gpu
  # jax 0.12.1 removed this kernel; test_attention_backends.py checks the error there.
  pallas_gpu = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention")
  calls, real = [], pallas_gpu.mha

  def record(q, k, v, segment_ids, **kwargs):
    calls.append(dict(q=q, k=k, segment_ids=segment_ids, **kwargs))
    kwargs["interpret"] = True
    return real(q, k, v, segment_ids, **kwargs)

  monkeypatch.setattr(pallas_gpu, "mha", record)
  spec = AttentionSpec.self_attention(PACKED, causal=True)
  q, k, v = _qkv(2, dtype=jnp.float32)
  _assert_close_to_dense(BACKENDS["pallas"], spec, q, k, v, bound=1e-5)
  call = calls[0]
  assert call["causal"] and call["k"].shape[2] == N
  padded = call["segment_ids"].shape[1]
  np.testing.assert_array_equal(call["segment_ids"][:, :T], PACKED)
  np.testing.assert_array_equal(call["segment_ids"][:, T:], np.zeros((B, padded - T)))


@pytest.mark.parametrize("name", ["gpt2", "transformer"])
def test_models_pass_their_packing_promise_to_cudnn(name, cudnn_calls):
  """Self- and cross-attention of a model with packed_inputs=False reach cuDNN without a
  mask and match `dense`; packed_inputs=True is refused, naming the backends that pack."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from tests.layers.test_attention_models import _batch  # pylint: disable=g-import-not-at-top
  from tests.models.variants import VARIANTS  # pylint: disable=g-import-not-at-top
  from tx_jax.models import build, model_inputs  # pylint: disable=g-import-not-at-top

  config = dataclasses.replace(VARIANTS[name], dtype="bfloat16", packed_inputs=False)
  args, kwargs = model_inputs(config, _batch(config.family, packed=False))
  dense_model = build(dataclasses.replace(config, attention_backend="dense"))
  params = dense_model.init(jax.random.PRNGKey(0), *args, **kwargs)
  want = dense_model.apply(params, *args, **kwargs)
  got = build(dataclasses.replace(config, attention_backend="cudnn")).apply(params, *args, **kwargs)
  stacks = config.num_layers + config.num_decoder_layers * 2  # decoder: self and cross
  assert len(cudnn_calls) == stacks and all(c["mask"] is None for c in cudnn_calls)
  weights = np.asarray(kwargs.get("segment_ids", kwargs.get("decoder_segment_ids"))) > 0
  error = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))[weights]
  assert np.max(error) < 0.1 * max(1.0, np.max(np.abs(np.asarray(want, np.float32))))
  packed = build(dataclasses.replace(config, attention_backend="cudnn", packed_inputs=True))
  with pytest.raises(ValueError, match="'pallas'"):
    packed.apply(params, *args, **kwargs)
