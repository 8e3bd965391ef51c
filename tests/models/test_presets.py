"""Every preset builds abstractly; published presets reproduce HF's parameter counts."""

import importlib

import pytest

from tx_jax.models import ModelConfig
from tx_jax.models.summary import count_params, describe

# HuggingFace's counts of the same architectures and vocabularies (the table, plus
# the public figures of gpt2-large / gpt2-xl / t5-large / t5-v1_1 / TinyLlama-1.1B).
PUBLISHED = {
    ("bert", "base"): 109_482_240,
    ("bert", "large"): 335_141_888,
    ("gpt", "gpt2-small"): 124_439_808,
    ("gpt", "gpt2-medium"): 354_823_168,
    ("gpt", "gpt2-large"): 774_030_080,
    ("gpt", "gpt2-xl"): 1_557_611_200,
    ("gpt", "llama-1b"): 1_100_048_384,
    ("t5", "t5-small"): 60_506_624,
    ("t5", "t5-base"): 222_903_552,
    ("t5", "t5-large"): 737_668_096,
    ("t5", "t5.1.1-small"): 76_961_152,
    ("t5", "t5.1.1-base"): 247_577_856,
}
FAMILY_FILES = ("transformer", "bert", "gpt", "t5")
ALL_PRESETS = [
    (f, p) for f in FAMILY_FILES for p in importlib.import_module(f"configs.{f}").PRESETS
]


def _config(family_file, preset):
  return importlib.import_module(f"configs.{family_file}").get_config(preset)


@pytest.mark.parametrize("family_file,preset", ALL_PRESETS)
def test_preset_builds_and_counts(family_file, preset):
  config = _config(family_file, preset)
  counts = count_params(ModelConfig.from_config(config.model))
  if (family_file, preset) in PUBLISHED:
    assert counts.backbone == PUBLISHED[family_file, preset]


def test_transformer_base_matches_table_3():
  """N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, shared 37k vocab: ~63M (paper: 65M)."""
  m = _config("transformer", "base").model
  assert (
      m.num_layers,
      m.num_decoder_layers,
      m.d_model,
      m.mlp_dim,
      m.num_heads,
      m.head_dim,
      m.dropout_rate,
      m.vocab_size,
  ) == (6, 6, 512, 2048, 8, 64, 0.1, 37000)
  assert count_params(ModelConfig.from_config(m)).backbone == 63_045_632


def test_describe_prints_the_grep_line_and_flops():
  text = describe(_config("gpt", "gpt2-small"))
  assert "params: 124439808" in text.splitlines()
  # 6·N for N = 124,439,808 - 786,432 position-table entries (no matmul) + attention.
  assert "training FLOPs/token" in text and "stack" in text


def test_flops_per_token_by_hand():
  """GPT-2 small at T=1024: 6·(85M blocks + 38.6M tied logits) + 12·12·1024·768."""
  config = _config("gpt", "gpt2-small")
  model = ModelConfig.from_config(config.model)
  counts = count_params(model)
  from tx_jax.models.summary import flops_per_token

  blocks = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
  expected = 6 * (blocks + 50257 * 768) + 12 * 12 * 1024 * 768
  assert counts.matmul == blocks + 50257 * 768
  assert flops_per_token(model, counts, 1024) == expected


def test_unknown_preset_lists_the_accepted_ones():
  with pytest.raises(ValueError, match="accepted"):
    _config("gpt", "gpt5")


def test_invalid_model_fields_name_the_field():
  config = _config("gpt", "tiny")
  config.model.num_kv_heads = 3
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    ModelConfig.from_config(config.model)
  config.model.num_kv_heads = 4
  config.model.positions = "absolute"
  with pytest.raises(ValueError, match="positions='absolute'"):
    ModelConfig.from_config(config.model)
