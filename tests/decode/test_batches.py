"""encode_sources / decode_batches: batching and filler rows change no output.

The reference decodes each input alone (batch 1, padded to WIDTH_MULTIPLE, so it
compiles once) with the entry points of generate.py, which tests/decode/test_generate.py
checks against an unpadded, uncached argmax loop.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gpt, transformer
from tx_jax import decode, models
from tx_jax.data.tokenizers import ByteTokenizer
from tx_jax.decode.batches import WIDTH_MULTIPLE
from tests.tiers import slow_except

EOS = 2
# Ids that these seeds' greedy outputs emit mid-row, so EOS stopping and stripping are tested.
FAMILY_EOS = {"decoder": 38, "encdec": 2}


def tiny(config):
  m = config.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 40, 16, 1, 2, 2
  m.head_dim, m.mlp_dim, m.max_len = 8, 32, 32
  m.num_decoder_layers = 1 if m.family == "encdec" else 0
  m.dropout_rate = 0.0
  module = models.build(m)
  inputs = (jnp.zeros((1, 4), jnp.int32),) * (2 if m.family == "encdec" else 1)
  params = jax.jit(lambda k: module.init(k, *inputs, train=False)["params"])(jax.random.key(5))
  # Sharper logits: no argmax ties, and EOS appears in some rows.
  return module, jax.tree.map(lambda x: x * 3.0, nn.meta.unbox(params))


@functools.lru_cache(maxsize=None)
def decoder():
  return tiny(gpt.get_config("tiny"))


@functools.lru_cache(maxsize=None)
def encdec():
  return tiny(transformer.get_config("tiny"))


def alone(module, params, row, strategy, eos):
  """The best hypothesis for one input decoded by itself, EOS stripped."""
  width = WIDTH_MULTIPLE
  if module.config.family == "decoder":
    prompt = decode.make_prompt([row], max_new_tokens=strategy.max_new_tokens, pad_to=width)
    out = decode.generate(module, params, prompt, strategy, eos_id=eos)
  else:
    ids = np.zeros((1, width), np.int32)
    ids[0, : len(row)] = row
    out = decode.translate(
        module, params, ids, (ids > 0).astype(np.int32), strategy, eos_id=eos, decoder_start_id=1
    )
  top = decode.best(out)
  return decode.strip_generated(np.asarray(top.tokens[0]), int(top.lengths[0]), eos)


def test_encode_sources_ends_sources_with_eos_like_training():
  tok = ByteTokenizer(num_sentinels=0)
  texts = ["abc", "", "abcdefgh"]
  ids = [tok.encode(t) for t in texts]
  got = decode.encode_sources(tok, texts, append_eos=True, max_len=5)
  assert got == [ids[0] + [tok.eos_id], [tok.eos_id], ids[2][:4] + [tok.eos_id]]
  assert decode.encode_sources(tok, texts, append_eos=True) == [i + [tok.eos_id] for i in ids]
  # A prompt keeps its end: the tokens a continuation follows.
  assert decode.encode_sources(tok, texts, append_eos=False, max_len=3) == [
      ids[0],
      [],
      ids[2][-3:],
  ]


@pytest.mark.parametrize("family", slow_except(["decoder", "encdec"], "decoder"))
@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_decode_batches_equals_one_input_at_a_time(family, name):
  module, params = decoder() if family == "decoder" else encdec()
  inputs = [[5, 9, 3, 7], [11], [6, 30, 2, 17, 9, 12, 13]]
  strategy = decode.Strategy(name, max_new_tokens=6, beam_size=3, alpha=0.6)
  # Batches of 2: the second holds one input and one filler row.
  eos = FAMILY_EOS[family]
  got = decode.decode_batches(
      module, params, inputs, strategy, eos_id=eos, decoder_start_id=1, batch_size=2
  )
  want = [alone(module, params, row, strategy, eos) for row in inputs]
  assert got == want
  assert any(len(w) < 6 for w in want), "no row stopped at EOS; the test would miss stripping"


@pytest.mark.slow  # the same programs at other widths and on a mesh
def test_decode_batches_fixed_width_and_sharding_change_nothing():
  module, params = encdec()
  inputs = [[5, 9, 3, 7], [11, 2]]
  strategy = decode.Strategy("greedy", max_new_tokens=5)
  want = decode.decode_batches(
      module, params, inputs, strategy, eos_id=EOS, decoder_start_id=1, batch_size=4
  )
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  got = decode.decode_batches(
      module,
      params,
      inputs,
      strategy,
      eos_id=EOS,
      decoder_start_id=1,
      batch_size=4,
      width=24,
      sharding=sharding,
  )
  assert got == want


def test_decode_batches_errors_name_the_input():
  module, params = encdec()
  strategy = decode.Strategy("greedy", max_new_tokens=3)
  kwargs = dict(eos_id=EOS, decoder_start_id=1, batch_size=2)
  with pytest.raises(ValueError, match="input 1 is empty"):
    decode.decode_batches(module, params, [[3], []], strategy, **kwargs)
  with pytest.raises(ValueError, match="input 0 has 33 tokens, longer than model.max_len=32"):
    decode.decode_batches(module, params, [[3] * 33], strategy, **kwargs)
  with pytest.raises(ValueError, match=r"width=2 is shorter than the longest input \(3\)"):
    decode.decode_batches(module, params, [[3, 4, 5]], strategy, width=2, **kwargs)
  with pytest.raises(ValueError, match="batch_size=0 must be an int >= 1"):
    decode.decode_batches(module, params, [[3]], strategy, **{**kwargs, "batch_size": 0})
  assert decode.decode_batches(module, params, [], strategy, **kwargs) == []
