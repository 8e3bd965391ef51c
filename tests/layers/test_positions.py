"""Position schemes against their papers' formulas."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.layers import positions


def test_sinusoidal_embedding_equals_the_papers_formula():
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same)."""
  max_len, d = 50, 16
  table = np.asarray(positions.sinusoidal_embedding(jnp.arange(max_len)[None], d)[0])
  for pos in range(max_len):
    for i in range(d // 2):
      angle = pos / 10000 ** (2 * i / d)
      assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=3e-5)
      assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=3e-5)


def test_rope_scores_depend_only_on_the_offset():
  """<rope(q, i), rope(k, j)> is a function of i - j: shifting both leaves it unchanged."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)

  def score(i, j):
    qi = positions.apply_rope(q, jnp.array([[i]]), theta=10000.0)
    kj = positions.apply_rope(k, jnp.array([[j]]), theta=10000.0)
    return np.asarray(jnp.sum(qi * kj, axis=-1))

  for offset in (0, 1, 5):
    base = score(3 + offset, 3)
    for shift in (7, 40, 300):
      np.testing.assert_allclose(score(3 + offset + shift, 3 + shift), base, atol=1e-4)
  assert not np.allclose(score(4, 3), score(9, 3), atol=1e-3)


def test_rope_matches_the_complex_rotation():
  """Half-split RoPE rotates (x_i, x_{i+H/2}) by pos·theta^(-2i/H), as a complex product."""
  rng = np.random.default_rng(1)
  h, pos, theta = 8, 11, 500.0
  x = rng.standard_normal(h)
  out = np.asarray(
      positions.apply_rope(jnp.asarray(x, jnp.float32)[None, None, None], jnp.array([[pos]]), theta)
  )[0, 0, 0]
  freqs = theta ** (-np.arange(0, h, 2) / h)
  z = (x[: h // 2] + 1j * x[h // 2 :]) * np.exp(1j * pos * freqs)
  np.testing.assert_allclose(out, np.concatenate([z.real, z.imag]), atol=1e-5)


def reference_t5_bucket(rel, bidirectional, num_buckets, max_distance):
  """Scalar transcription of T5's _relative_position_bucket (mesh_tensorflow / HF)."""
  ret = 0
  n = -rel
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      ret += num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val = max_exact + int(
      math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  )
  return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_reference(bidirectional):
  rel = np.arange(-300, 301)
  ours = np.asarray(positions.t5_relative_position_bucket(jnp.asarray(rel), bidirectional, 32, 128))
  expected = [reference_t5_bucket(int(r), bidirectional, 32, 128) for r in rel]
  np.testing.assert_array_equal(ours, expected)


def test_relative_bias_is_one_table_lookup_per_offset():
  module = positions.RelativePositionBias(num_heads=3, num_buckets=8, max_distance=16)
  pos = jnp.arange(5)[None]
  variables = module.init(jax.random.PRNGKey(0), pos, pos)
  table = np.asarray(nn.unbox(variables["params"])["rel_embedding"])
  bias = np.asarray(module.apply(variables, pos, pos))
  assert bias.shape == (1, 3, 5, 5)
  for i in range(5):
    for j in range(5):
      bucket = reference_t5_bucket(j - i, True, 8, 16)
      np.testing.assert_array_equal(bias[0, :, i, j], table[bucket])


def test_alibi_slopes_and_bias():
  np.testing.assert_allclose(positions.alibi_slopes(8), [2 ** -(i + 1) for i in range(8)])
  assert len(positions.alibi_slopes(12)) == 12
  pos = jnp.arange(4)[None]
  bias = np.asarray(positions.alibi_bias(pos, pos, 2))
  slopes = positions.alibi_slopes(2)
  for i in range(4):
    for j in range(4):
      np.testing.assert_allclose(bias[0, :, i, j], -slopes * abs(i - j))


def test_learned_positions_look_up_rows():
  module = positions.LearnedPositions(max_len=10, dim=4)
  pos = jnp.array([[0, 3, 9]])
  variables = module.init(jax.random.PRNGKey(0), pos)
  table = np.asarray(nn.unbox(variables["params"])["embedding"])
  np.testing.assert_array_equal(np.asarray(module.apply(variables, pos))[0], table[[0, 3, 9]])


def test_t5_buckets_without_a_log_range_use_the_last_bucket():
  """max_distance = num_buckets // 2 (unidirectional) leaves no log-spaced range: distances
  past the exact ones must land in the last bucket, not in a NaN cast to an index."""
  rel = jnp.arange(-40, 1)
  buckets = np.asarray(positions.t5_relative_position_bucket(rel, False, 32, 16))
  np.testing.assert_array_equal(buckets[::-1][:16], np.arange(16))
  np.testing.assert_array_equal(buckets[::-1][16:], 31)
