"""Every preset builds abstractly; published presets reproduce HF's parameter counts."""

import contextlib
import importlib

import numpy as np
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


def test_encoder_decoder_flops_per_token_by_hand():
  """Transformer base, S=100 source and T=50 target tokens: each stack's weights act on its
  own tokens; the tied 37k output projection on the target's."""
  from tx_jax.models.summary import flops_per_token

  model = ModelConfig.from_config(_config("transformer", "base").model)
  counts = count_params(model)
  encoder = 6 * (4 * 512 * 512 + 2 * 512 * 2048)
  decoder = 6 * (8 * 512 * 512 + 2 * 512 * 2048) + 37000 * 512
  assert (counts.encoder_matmul, counts.matmul) == (encoder, encoder + decoder)
  attention = 12 * 8 * 64 * (6 * 100 * 100 + 6 * (50 * 50 + 50 * 100))
  expected = (6 * (encoder * 100 + decoder * 50) + attention) / 150
  assert flops_per_token(model, counts, 100, 50) == pytest.approx(expected, rel=1e-12)


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


# --- every preset trains as shipped (ARCHITECTURE.md: "First contact") ---
# Tiny presets train a few steps as shipped; the others are dry-run (abstract, no weights).
TINY = [(f, p) for f, p in ALL_PRESETS if "tiny" in p or p in ("default", "multi30k")]
LARGE = [fp for fp in ALL_PRESETS if fp not in TINY]
# Presets reading data that is not in the repository.
NEEDS_DATA_DIR = {("gpt", "tiny-shakespeare"), ("bert", "tiny-mlm"), ("t5", "tiny-span")}


@pytest.mark.parametrize("family_file,preset", ALL_PRESETS)
def test_preset_passes_validation_as_shipped(family_file, preset):
  from tx_jax import validation

  config = _config(family_file, preset)
  if (family_file, preset) == ("transformer", "multi30k"):
    # Its SentencePiece vocabulary is made by experiments.train_tokenizer first (README).
    with pytest.raises(FileNotFoundError, match="data.spm_model_path.*train_tokenizer"):
      validation.train_config(config)
    return
  validation.train_config(config)
  family, task = config.model.family, config.data.task
  assert task in validation.FAMILY_TASKS[family]


def test_the_decoder_default_preset_is_a_language_model():
  """The issue's first contact: configs/gpt.py:tiny used to inherit the seq2seq task."""
  assert _config("gpt", "tiny").data.task == "lm"
  assert _config("bert", "tiny").data.task == "mlm"
  assert _config("t5", "tiny").data.task == "span_corruption"


def _few_steps(config, tmp_path):
  """The preset as shipped, for 2 steps and one small eval (the schedule's warm-up shortened)."""
  t = config.train
  t.steps, t.eval_every, t.log_every, t.eval_batches = 2, 0, 1, 1
  t.decode_examples, t.print_examples, t.plot, t.progress = 4, 0, False, "log"
  config.schedule.warmup_steps = 1
  config.checkpoint.every = 0
  if config.data.source == "tfds":
    config.data.tfds_data_dir = str(tmp_path / "tfds")  # prepared here, not in ~/
  return config


@pytest.mark.slow
@pytest.mark.parametrize("family_file,preset", TINY)
def test_tiny_preset_trains_as_shipped(family_file, preset, tmp_path, monkeypatch):
  from tx_jax import validation
  from tx_jax.train import loop

  if (family_file, preset) in NEEDS_DATA_DIR or preset == "multi30k":
    from tests.conftest import shared_data_dir

    if shared_data_dir() is None:
      pytest.skip("offline data not found: set TX_JAX_DATA_DIR to a copy of shared/data")
    monkeypatch.setenv("TX_JAX_DATA_DIR", str(shared_data_dir()))  # read by get_config
  config = _few_steps(_config(family_file, preset), tmp_path)
  context = contextlib.nullcontext()
  if preset == "multi30k":  # step one of its README recipe: the shared 8k vocabulary
    from tx_jax.data import sources, tokenizers

    prefix = str(tmp_path / "spm")
    config.data.spm_model_path = tokenizers.train_sentencepiece(
        sources.texts(config.data, config.data.train_split),
        prefix,
        vocab_size=config.data.vocab_size,
        model_type=config.data.spm_model_type,
    )
  if preset == "tiny-sst2":  # glue/sst2 needs a download: TFDS's mock data stands in
    import tensorflow_datasets as tfds

    context = tfds.testing.mock_data(num_examples=64)
  with context:
    result = loop.train_and_evaluate(config, tmp_path / "run")
  assert result["step"] == 2 and np.isfinite(result["loss"]) and result["skipped_updates"] == 0
  # Every metric the eval promises exists (checkpoint.best_metric is validated against it).
  assert set(validation.eval_metric_names(config)) <= set(result)


@pytest.mark.slow
@pytest.mark.parametrize("family_file,preset", LARGE)
def test_large_preset_dry_runs(family_file, preset):
  from tx_jax.train import loop

  config = _config(family_file, preset)
  loop.validate(config)
  report = loop.dry_run_report(config)
  assert any(line.startswith("params: ") for line in report.splitlines())
