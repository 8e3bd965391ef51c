"""Tokenizers: round trips, the id layout (pad 0, sentinels from the top), SentencePiece training."""

import pytest

from tx_jax.data import tokenizers
from tests.data.helpers import make_config

TEXTS = ["Hello, world!", "Grüße aus Köln — ein Straßenbahn-Fahrer.", "日本語 テキスト 🎉", ""]


def test_byte_round_trip_and_ids():
  tok = tokenizers.build_tokenizer(make_config(tokenizer="byte").data)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == [b + 4 for b in text.encode("utf-8")]  # UTF-8 bytes past 4 specials
    assert tok.decode(ids) == text
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (0, 1, 2, 3)
  assert tok.vocab_size == 4 + 256 + 100
  assert tok.sentinel_id(0) == 359 and tok.sentinel_id(99) == 260  # counting down from the top
  assert (
      tok.decode([1, *tok.encode("ab"), tok.sentinel_id(0), *tok.encode("c"), 2, 0])
      == "ab<extra_id_0>c"
  )
  assert min(tok.regular_ids()) == 4 and max(tok.regular_ids()) == 259


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  lines = [
      f"the {w} sat on the mat number {i} and then the {w} ran away"
      for i, w in enumerate(["cat", "dog", "bird", "fish", "fox", "horse"] * 40)
  ]
  return tmp_path_factory.mktemp("spm"), lines


def test_sentencepiece_train_load_round_trip(corpus):
  folder, lines = corpus
  path = tokenizers.train_sentencepiece(lines, str(folder / "m"), vocab_size=60)
  cfg = make_config(tokenizer="sentencepiece", spm_model_path=path, num_sentinels=10).data
  tok = tokenizers.build_tokenizer(cfg)
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.mask_id) == (0, 1, 2, 4)
  assert tok.vocab_size == tok.base_vocab_size + 10
  assert tok.sentinel_id(0) == tok.vocab_size - 1
  for text in lines[:20] + ["the cat ran"]:
    assert tok.decode(tok.encode(text)) == text
  assert {0, 1, 2, 3, 4} <= tok.special_ids and not set(tok.regular_ids()) & tok.special_ids
  import pickle  # grain workers receive the tokenizer pickled

  again = pickle.loads(pickle.dumps(tok))
  assert again.encode(lines[0]) == tok.encode(lines[0])


def test_t5_style_model_without_bos(corpus):
  """T5's layout: pad 0, eos 1, unk 2, no bos: decoder start is pad, no [MASK]."""
  import sentencepiece as spm

  folder, lines = corpus
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines),
      model_prefix=str(folder / "t5"),
      vocab_size=50,
      pad_id=0,
      eos_id=1,
      unk_id=2,
      bos_id=-1,
      hard_vocab_limit=False,
      minloglevel=2,
  )
  tok = tokenizers.SentencePieceTokenizer(str(folder / "t5.model"), num_sentinels=100)
  assert tok.bos_id is None and tok.decoder_start_id == 0 and tok.mask_id is None
  assert tok.decode(tok.encode(lines[3]) + [1]) == lines[3]


def test_bad_tokenizer_config_names_field(tmp_path):
  with pytest.raises(ValueError, match="data.tokenizer='bpe'"):
    tokenizers.build_tokenizer(make_config(tokenizer="bpe").data)
  with pytest.raises(FileNotFoundError, match="data.spm_model_path"):
    tokenizers.build_tokenizer(
        make_config(tokenizer="sentencepiece", spm_model_path=str(tmp_path / "no.model")).data
    )


def test_train_tokenizer_command(tmp_path, corpus):
  """`python -m experiments.train_tokenizer --config=...` trains on the configured files."""
  import pathlib
  import subprocess
  import sys

  _, lines = corpus
  text = tmp_path / "corpus.txt"
  text.write_text("\n".join(lines), encoding="utf-8")
  root = pathlib.Path(__file__).resolve().parents[2]
  subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.train_tokenizer",
          "--config=configs/transformer.py",
          "--config.data.source=text_files",
          "--config.data.task=lm",
          f"--config.data.train_files={text}",
          "--config.data.vocab_size=60",
          f"--model_prefix={tmp_path / 'cli'}",
      ],
      cwd=root,
      check=True,
      capture_output=True,
  )
  tok = tokenizers.SentencePieceTokenizer(str(tmp_path / "cli.model"))
  assert tok.decode(tok.encode(lines[7])) == lines[7] and tok.mask_id == 4
