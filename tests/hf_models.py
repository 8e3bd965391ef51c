"""Small random transformers models saved with a tokenizer of their family's kind.

Awkward on purpose: odd widths, GQA, a T5 model vocabulary larger than its tokenizer's (as
T5's 32128 vs 32100), special ids that differ from tx_jax's byte tokenizer (so a decode that
fell back to the byte ids would differ), weights perturbed so greedy never meets a tie.
Tokenizers are trained here with `tokenizers`' trainers on Tiny Shakespeare: byte-level BPE
(GPT-2), Metaspace BPE with byte fallback (LLaMA-2), Unigram with <extra_id_k> (T5).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import shared_data_dir
from tx_jax.data import hf_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("gpt2", "llama", "t5")
TOKENIZER_KIND = {"gpt2": "byte_bpe", "llama": "bpe", "t5": "unigram"}
TOKENIZER_VOCAB = {"gpt2": 331, "llama": 389, "t5": 290}
T5_SENTINELS = 10


def shakespeare_lines(count: int = 3000) -> list[str]:
  """The first `count` non-empty lines of Tiny Shakespeare (skips the test when absent)."""
  root = shared_data_dir()
  if root is None:
    pytest.skip("offline data not found: set TX_JAX_DATA_DIR to a copy of shared/data")
  text = (root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  return [line for line in text.splitlines() if line.strip()][:count]


def _model(family: str, vocab: int):
  if family == "gpt2":
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=24,
            n_layer=2,
            n_head=3,
            n_positions=96,
            bos_token_id=1,
            eos_token_id=1,
        )
    )
  if family == "llama":
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=44,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=96,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
  return transformers.T5ForConditionalGeneration(
      transformers.T5Config(
          vocab_size=vocab + 14,
          d_model=32,
          d_kv=8,
          d_ff=40,
          num_layers=2,
          num_decoder_layers=2,
          num_heads=4,
          relative_attention_num_buckets=8,
          relative_attention_max_distance=16,
          feed_forward_proj="gated-gelu",
          tie_word_embeddings=False,
          pad_token_id=0,
          eos_token_id=1,
          decoder_start_token_id=0,
      )
  )


_SPECIALS = {
    "gpt2": {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
    },
    "llama": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "t5": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
}


def save_model(
    family: str,
    path: pathlib.Path,
    *,
    with_tokenizer: bool = True,
    scale: float = 0.5,
    **config_overrides,
):
  """Saves a random `family` model (and its trained tokenizer) as an HF directory."""
  path.mkdir(parents=True, exist_ok=True)
  vocab = TOKENIZER_VOCAB[family]
  if with_tokenizer:
    file = hf_tokenizer.train_hf_tokenizer(
        ["\n".join(shakespeare_lines())],
        path / "trained",
        kind=TOKENIZER_KIND[family],
        vocab_size=vocab,
        num_sentinels=T5_SENTINELS if family == "t5" else 0,
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file), **_SPECIALS[family])
    assert len(tok) == vocab, (family, len(tok))
    tok.save_pretrained(path)
  torch.manual_seed(0)
  model = _model(family, vocab)
  for key, value in config_overrides.items():
    setattr(model.config, key, value)
    setattr(model.generation_config, key, value)
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for param in model.parameters():
      param.add_(scale * torch.randn(param.shape, generator=gen))
  model.eval()
  model.save_pretrained(path, safe_serialization=True)
  return model, (tok if with_tokenizer else None)


def hf_generate(model, tok, text: str, max_new_tokens: int) -> tuple[list[int], str]:
  """transformers: tokenise -> generate(do_sample=False) -> (new ids up to EOS, decoded text)."""
  ids = tok(text, return_tensors="pt")["input_ids"]
  with torch.no_grad():
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        pad_token_id=getattr(model.config, "pad_token_id", None) or 0,
    )
  new = out[0, 1:] if model.config.is_encoder_decoder else out[0, ids.shape[1] :]
  new = cut_at_eos(new.tolist(), model.config.eos_token_id)
  return new, tok.decode(new, skip_special_tokens=True)


def cut_at_eos(ids: list[int], eos: int) -> list[int]:
  """Ids before the first EOS (tx_jax's decode strips it; HF pads finished rows after it)."""
  return ids[: ids.index(eos)] if eos in ids else ids
