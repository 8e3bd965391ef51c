"""Prompt batches (left padding), stripping, and the argument checks of tx_jax.decode.prompts."""

import numpy as np
import pytest

from tx_jax import decode


def test_make_prompt_left_pads():
  p = decode.make_prompt([[5, 6, 7], [8]], max_new_tokens=2)
  np.testing.assert_array_equal(p.tokens, [[5, 6, 7], [0, 0, 8]])
  np.testing.assert_array_equal(p.segment_ids, [[1, 1, 1], [0, 0, 1]])
  np.testing.assert_array_equal(p.positions, [[0, 1, 2], [0, 0, 0]])
  np.testing.assert_array_equal(p.lengths, [3, 1])


def test_make_prompt_pad_to():
  p = decode.make_prompt([[5, 6]], max_new_tokens=2, pad_to=4)
  np.testing.assert_array_equal(p.tokens, [[0, 0, 5, 6]])
  with pytest.raises(ValueError, match="pad_to=1 is shorter than the longest prompt"):
    decode.make_prompt([[5, 6]], max_new_tokens=2, pad_to=1)


def test_strip_generated_drops_only_a_final_eos():
  assert decode.strip_generated([7, 8, 2, 0], 3, eos_id=2) == [7, 8]
  assert decode.strip_generated([7, 8, 9, 4], 4, eos_id=2) == [7, 8, 9, 4]
  assert decode.strip_generated([7, 2, 0], 2, eos_id=None) == [7, 2]


def test_empty_prompt_is_an_error():
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    decode.make_prompt([[3, 4], []], max_new_tokens=4)


def test_prompt_longer_than_max_len_is_an_error():
  with pytest.raises(ValueError, match=r"prompt 0 has 9 tokens.*max_len=8"):
    decode.make_prompt([list(range(2, 11))], max_new_tokens=1, max_len=8)
  with pytest.raises(ValueError, match=r"max_new_tokens=6 .*max_len=8.*<= 5"):
    decode.make_prompt([[2, 3, 4, 5]], max_new_tokens=6, max_len=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.0, top_k=0, top_p=1.0), "temperature=0.0"),
        (dict(temperature=1.0, top_k=-1, top_p=1.0), "top_k=-1"),
        (dict(temperature=1.0, top_k=0, top_p=1.5), r"top_p=1.5 must lie in \(0, 1\]"),
    ],
)
def test_bad_sampling_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    decode.check_sampling(**kwargs)


def test_bad_beam_arguments():
  with pytest.raises(ValueError, match="beam_size=0"):
    decode.check_beam(0, 0.6)
  with pytest.raises(ValueError, match="alpha=-1"):
    decode.check_beam(4, -1.0)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    decode.make_prompt([[2]], max_new_tokens=0)
