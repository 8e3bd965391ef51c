"""Greedy decoding equals transformers' `generate(do_sample=False)` on the same weights.

Small random transformers models (GPT-2, LLaMA with GQA, T5 v1.1) are perturbed so
their logits are far from ties, saved as safetensors, loaded through `tx_jax.hf`, and
decoded by both sides from a ragged batch: left-padded prompts for the decoders,
right-padded sources for T5, with EOS stopping.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tx_jax import decode, hf  # noqa: E402

N_NEW = 8
PROMPTS = [[5, 17, 3, 9, 22], [14], [8, 30, 6]]
EOS = 2


def _gpt2():
  return transformers.GPT2LMHeadModel(
      transformers.GPT2Config(
          vocab_size=61,
          n_embd=32,
          n_layer=2,
          n_head=4,
          n_positions=32,
          bos_token_id=1,
          eos_token_id=EOS,
          pad_token_id=0,
      )
  )


def _llama():
  return transformers.LlamaForCausalLM(
      transformers.LlamaConfig(
          vocab_size=61,
          hidden_size=32,
          intermediate_size=40,
          num_hidden_layers=2,
          num_attention_heads=4,
          num_key_value_heads=2,
          tie_word_embeddings=False,
          max_position_embeddings=32,
          bos_token_id=1,
          eos_token_id=EOS,
          pad_token_id=0,
      )
  )


def _t5():
  return transformers.T5ForConditionalGeneration(
      transformers.T5Config(
          vocab_size=61,
          d_model=32,
          d_kv=8,
          d_ff=48,
          num_layers=2,
          num_decoder_layers=2,
          num_heads=4,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=16,
          feed_forward_proj="gated-gelu",
          pad_token_id=0,
          eos_token_id=1,
          decoder_start_token_id=0,
      )
  )


def _save(build, path, scale):
  torch.manual_seed(0)  # the random init, independent of test order
  model = build()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for param in model.parameters():
      param.add_(scale * torch.randn(param.shape, generator=gen))
  model.eval()
  model.save_pretrained(path, safe_serialization=True)
  return model


def _hf_rows(sequences, eos):
  """Generated ids per row, cut after the first EOS (HF pads finished rows)."""
  rows = []
  for seq in sequences.tolist():
    out = []
    for t in seq:
      out.append(t)
      if t == eos:
        break
    rows.append(out)
  return rows


def _ours(result):
  return [
      [int(t) for t in result.tokens[b, : int(result.lengths[b])]]
      for b in range(result.tokens.shape[0])
  ]


# EOS ids that these seeds emit early in some rows, so stopping is compared too.
@pytest.mark.parametrize(
    "build, eos",
    [pytest.param(_gpt2, EOS, id="gpt2", marks=pytest.mark.slow), pytest.param(_llama, 9, id="llama_gqa")],
)
def test_decoder_greedy_equals_transformers_generate(build, eos, tmp_path):
  model = _save(build, tmp_path, scale=0.5)
  width = max(map(len, PROMPTS))
  ids = np.zeros((len(PROMPTS), width), np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(PROMPTS):
    ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
  with torch.no_grad():
    out = model.generate(
        torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        max_new_tokens=N_NEW,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=0,
    )
  want = _hf_rows(out[:, width:].numpy(), eos)
  assert any(len(r) < N_NEW for r in want), "no row stopped at EOS"

  _, module, params = hf.from_pretrained(tmp_path)
  module, params = decode.decoding_module(module.config, params)
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=N_NEW, max_len=module.config.max_len)
  greedy = decode.Strategy("greedy", max_new_tokens=N_NEW)
  got = _ours(decode.generate(module, params, prompt, greedy, eos_id=eos))
  assert got == want


def test_t5_greedy_equals_transformers_generate(tmp_path):
  model = _save(_t5, tmp_path, scale=0.5)
  sources = [[5, 17, 3, 9, 22, 1], [14, 1], [8, 30, 6, 1]]
  width = max(map(len, sources))
  ids = np.zeros((len(sources), width), np.int64)
  for i, s in enumerate(sources):
    ids[i, : len(s)] = s
  mask = (ids != 0).astype(np.int64)
  with torch.no_grad():
    out = model.generate(
        torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        max_new_tokens=N_NEW,
        do_sample=False,
        num_beams=1,
    )
  want = _hf_rows(out[:, 1:].numpy(), eos=1)  # column 0 is the decoder start id
  assert any(len(r) < N_NEW for r in want), "no row stopped at EOS"

  _, module, params = hf.from_pretrained(tmp_path)
  module, params = decode.decoding_module(module.config, params)
  got = _ours(
      decode.translate(
          module,
          params,
          ids.astype(np.int32),
          mask.astype(np.int32),
          decode.Strategy("greedy", max_new_tokens=N_NEW),
          eos_id=1,
          decoder_start_id=0,
      )
  )
  assert got == want
