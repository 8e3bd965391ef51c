"""convert --from_hf keeps the tokenizer and special ids; --to_hf hands both back to HF."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_models
from tx_jax import workdir as wd

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["To be, or not to be", "Grüße 🎉 日本", "  spaced  out  ", "GONZALO: Sir, he may"]


def _auto(model):
  return (
      transformers.AutoModelForSeq2SeqLM
      if model.config.is_encoder_decoder
      else transformers.AutoModelForCausalLM
  )


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_from_hf_to_hf_keeps_model_and_tokenizer(family, tmp_path):
  model, tok = hf_models.save_model(family, tmp_path / "src")
  wd.import_hf(tmp_path / "src", tmp_path / "workdir")
  config = wd.read_config(tmp_path / "workdir")
  hf_ids = {
      field: getattr(model.config, key, None)
      for field, key in (
          ("bos_id", "bos_token_id"),
          ("eos_id", "eos_token_id"),
          ("pad_id", "pad_token_id"),
          ("decoder_start_id", "decoder_start_token_id"),
      )
  }
  assert {k: config.data[k] for k in hf_ids} == hf_ids
  assert config.data.tokenizer == "hf"
  assert config.data.tokenizer_path == str(tmp_path / "workdir" / "tokenizer")
  assert (tmp_path / "workdir" / "tokenizer" / "tokenizer.json").is_file()
  ours = wd.build_tokenizer(config)
  encoder = model.config.is_encoder_decoder
  assert [ours.encode_input(t, encoder=encoder) for t in TEXTS] == [
      tok(t)["input_ids"] for t in TEXTS
  ]

  wd.export_hf(tmp_path / "workdir", tmp_path / "out")
  back = _auto(model).from_pretrained(tmp_path / "out")
  back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
    assert getattr(back.config, key, None) == getattr(model.config, key, None), key
  for text in TEXTS:
    assert back_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert back_tok.decode(tok(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
  assert (back_tok.eos_token_id, back_tok.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
  ids = torch.tensor([tok(TEXTS[0])["input_ids"]])
  extra = {"decoder_input_ids": ids[:, :3]} if model.config.is_encoder_decoder else {}
  with torch.no_grad():
    want, got = model(ids, **extra).logits, back(ids, **extra).logits
  np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_t5_without_tokenizer_keeps_hf_ids_and_has_no_tokenizer(tmp_path):
  """No tokenizer: ids only, with the HF config's EOS and decoder start (not the byte ones)."""
  hf_models.save_model(
      "t5", tmp_path / "src", with_tokenizer=False, eos_token_id=3, decoder_start_token_id=5
  )
  wd.import_hf(tmp_path / "src", tmp_path / "workdir")
  config = wd.read_config(tmp_path / "workdir")
  assert config.data.tokenizer == "none" and not (tmp_path / "workdir" / "tokenizer").exists()
  assert wd.build_tokenizer(config) is None
  assert wd.special_ids(config, None) == wd.SpecialIds(bos=None, eos=3, pad=0, decoder_start=5)
  wd.export_hf(tmp_path / "workdir", tmp_path / "out")
  values = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (values["eos_token_id"], values["decoder_start_token_id"]) == (3, 5)


def test_tokenizer_larger_than_the_model_is_an_error_naming_both(tmp_path):
  hf_models.save_model("gpt2", tmp_path / "src")
  wd.import_hf(tmp_path / "src", tmp_path / "workdir")
  config = wd.read_config(tmp_path / "workdir")
  config.model.vocab_size = 300
  with pytest.raises(ValueError, match=r"vocab_size=300 is smaller than the 331 ids"):
    wd.build_tokenizer(config)
