"""HF tokenizer.json tokenizers equal transformers.PreTrainedTokenizerFast on the same file.

The tokenizers are trained inside the test with `tokenizers`' own trainers on Tiny
Shakespeare: a byte-level BPE like GPT-2's, a Metaspace BPE with byte fallback like
LLaMA-2's, a Unigram like T5's (with <extra_id_k> sentinels) and a WordPiece like BERT's.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tests.data.helpers import make_config
from tx_jax.data import hf_tokenizer, pipeline, tokenizers
from tests.tiers import slow_except

transformers = pytest.importorskip("transformers")

ODD = [
    "",
    " leading and  double  spaces ",
    "tab\there\nnew line",
    "Grüße aus Köln — Straßenbahn",
    "naïve cafe\u0301 (combining accent) ﬁ ligature",
    "日本語のテキスト、中文",
    "emoji 🎉 family 👩‍👩‍👧 flag 🇫🇷",
    "עברית مرحبا",
    "\u00a0non-breaking\u200bzero width",
    "x" * 300,
    "[CLS] <s> </s> [MASK] literal specials",
]
VOCAB = {"byte_bpe": 400, "bpe": 600, "unigram": 300, "wordpiece": 400}


@pytest.fixture(scope="module")
def shakespeare_lines():
  from tests.conftest import shared_data_dir

  root = shared_data_dir()
  if root is None:
    pytest.skip("offline data not found: set TX_JAX_DATA_DIR")
  lines = (root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()
  return [line for line in lines if line.strip()]


@pytest.fixture(scope="module")
def trained(shakespeare_lines, tmp_path_factory):
  """kind -> tokenizer.json trained on 4000 Shakespeare lines."""
  folder = tmp_path_factory.mktemp("hf_tok")
  return {
      kind: hf_tokenizer.train_hf_tokenizer(
          ["\n".join(shakespeare_lines[:4000])],
          folder / kind,
          kind=kind,
          vocab_size=size,
          num_sentinels=20 if kind == "unigram" else 0,
      )
      for kind, size in VOCAB.items()
  }


@pytest.mark.parametrize("kind", list(VOCAB))
def test_encode_decode_equal_transformers(kind, trained, shakespeare_lines):
  path = trained[kind]
  ours = tokenizers.build_tokenizer(
      make_config(tokenizer="hf", tokenizer_path=str(path), num_sentinels=0).data
  )
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
  texts = shakespeare_lines[-200:] + ODD  # lines after the training text
  for text in texts:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False), text
    with_specials = ours.encode_input(text, encoder=False)
    assert with_specials == theirs(text)["input_ids"], text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.decode(with_specials) == theirs.decode(with_specials, skip_special_tokens=True)
  lossless = {"byte_bpe": texts[:-1], "bpe": shakespeare_lines[-200:]}  # GPT-2's is lossless
  for text in lossless.get(kind, []):  # LLaMA-2's byte fallback keeps every character
    assert ours.decode(ours.encode(text)) == text
  assert ours.vocab_size == len(theirs)


def test_post_processors_add_the_families_specials(trained):
  """GPT-2 adds nothing, LLaMA-2 prepends <s>, T5 appends </s>, BERT wraps in [CLS] [SEP]."""
  text = "To be, or not to be"
  built = {
      kind: tokenizers.build_tokenizer(
          make_config(tokenizer="hf", tokenizer_path=str(trained[kind])).data
      )
      for kind in VOCAB
  }
  gpt = built["byte_bpe"]
  assert gpt.encode_input(text, encoder=False) == gpt.encode(text)
  assert gpt.encode_input(text, encoder=True) == [*gpt.encode(text), gpt.eos_id]  # as trained
  bpe, uni, wp = built["bpe"], built["unigram"], built["wordpiece"]
  assert bpe.encode_input(text, encoder=False) == [bpe.bos_id, *bpe.encode(text)]
  assert uni.encode_input(text, encoder=True) == [*uni.encode(text), uni.eos_id]
  assert wp.encode_input(text, encoder=False) == [wp.cls_id, *wp.encode(text), wp.sep_id]
  # Special ids found from the well-known names (no side files beside a bare tokenizer.json).
  assert (built["byte_bpe"].eos_id, bpe.bos_id, bpe.eos_id, uni.eos_id) == (1, 1, 2, 1)
  assert (wp.cls_id, wp.sep_id, wp.mask_id) == (2, 3, 4)
  assert uni.decoder_start_id == 0 and uni.bos_id is None  # T5: start with pad


def test_unigram_sentinels_are_t5s(trained):
  tok = tokenizers.build_tokenizer(
      make_config(tokenizer="hf", tokenizer_path=str(trained["unigram"])).data
  )
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(trained["unigram"]))
  assert tok.num_sentinels == 20  # from the vocabulary, not data.num_sentinels
  assert tok.sentinel_id(0) == tok.vocab_size - 1 == theirs.convert_tokens_to_ids("<extra_id_0>")
  assert tok.sentinel_id(19) == theirs.convert_tokens_to_ids("<extra_id_19>")
  assert not set(tok.regular_ids()) & (tok.special_ids | {tok.sentinel_id(i) for i in range(20)})


def test_side_files_name_the_specials(trained, tmp_path):
  """tokenizer_config.json written by transformers decides the roles, and overrides win."""
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(trained["byte_bpe"]),
      bos_token="<|endoftext|>",
      eos_token="<|endoftext|>",
      pad_token="<pad>",
      mask_token="[MASK]",
  )
  theirs.save_pretrained(tmp_path)
  tok = tokenizers.build_tokenizer(make_config(tokenizer="hf", tokenizer_path=str(tmp_path)).data)
  assert (tok.bos_id, tok.eos_id, tok.hf_pad_id, tok.mask_id) == (
      theirs.bos_token_id,
      theirs.eos_token_id,
      theirs.pad_token_id,
      theirs.mask_token_id,
  )
  tok = tokenizers.build_tokenizer(
      make_config(tokenizer="hf", tokenizer_path=str(tmp_path), eos_id=7, decoder_start_id=5).data
  )
  assert (tok.eos_id, tok.decoder_start_id) == (7, 5)
  again = pickle.loads(pickle.dumps(tok))  # grain workers receive it pickled
  assert (again.eos_id, again.encode("Good morrow")) == (7, tok.encode("Good morrow"))


def test_appended_sentinels_and_vocab_check(trained):
  cfg = make_config(tokenizer="hf", tokenizer_path=str(trained["byte_bpe"]), num_sentinels=10)
  tok = tokenizers.build_tokenizer(cfg.data)
  assert tok.vocab_size == tok.base_vocab_size + 10 == VOCAB["byte_bpe"] + 10
  ids = [*tok.encode("ab"), tok.sentinel_id(0), *tok.encode("c")]
  assert tok.decode(ids) == "ab<extra_id_0>c"
  tokenizers.check_fits(tok, VOCAB["byte_bpe"], with_sentinels=False)
  with pytest.raises(ValueError, match=r"vocab_size=400 is smaller than the 410 ids"):
    tokenizers.check_fits(tok, VOCAB["byte_bpe"])
  cfg.model = {"vocab_size": 300}
  cfg.data.task = "lm"
  with pytest.raises(ValueError, match=r"vocab_size=300 is smaller than the 400 ids"):
    pipeline.check_vocab(cfg)


def test_bad_paths_and_kinds_name_the_field(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.tokenizer_path"):
    tokenizers.build_tokenizer(make_config(tokenizer="hf", tokenizer_path=str(tmp_path)).data)
  with pytest.raises(ValueError, match="data.tokenizer='none'"):
    tokenizers.build_tokenizer(make_config(tokenizer="none").data)
  with pytest.raises(ValueError, match="data.hf_model_type='sentencepiece'"):
    hf_tokenizer.build_trainable("sentencepiece", vocab_size=10, num_sentinels=0)


@pytest.mark.parametrize(
    "task",
    slow_except(["lm", "mlm", "span_corruption", "seq2seq", "classification"], "lm", "seq2seq"),
)
def test_pipelines_run_on_an_hf_tokenizer(task, trained, tmp_path):
  """Every task builds batches from a tokenizer.json; LM targets decode back to the text."""
  text = tmp_path / "t.txt"
  text.write_text("First Citizen: Before we proceed any further, hear me speak.\n" * 8)
  tsv = tmp_path / "t.tsv"
  tsv.write_text("de\ten\ttext\tlabel\n" + "Guten Tag\tgood day\tgood day\t1\n" * 8)
  kind = {"mlm": "wordpiece", "span_corruption": "unigram", "classification": "wordpiece"}
  cfg = make_config(
      tokenizer="hf",
      tokenizer_path=str(trained[kind.get(task, "byte_bpe")]),
      task=task,
      source="text_files" if task in ("lm", "mlm", "span_corruption") else "tsv",
      train_files=str(text if task in ("lm", "mlm", "span_corruption") else tsv),
      seq_len=16,
      source_len=24,
      target_len=16,
      global_batch_size=4,
      num_sentinels=0,
  )
  cfg.model = {"vocab_size": 600}
  batch = next(pipeline.build_train_iterator(cfg, process_index=0, process_count=1))
  key = "encoder_inputs" if task in ("seq2seq", "span_corruption") else "inputs"
  assert batch[key].shape[0] == 4 and batch[key].max() < 600
  tok = tokenizers.build_tokenizer(cfg.data)
  if task == "lm":
    targets = batch["targets"][0][batch["weights"][0] > 0]
    line = "First Citizen: Before we proceed any further, hear me speak."
    assert tok.decode(targets) in line * 3
  if task == "span_corruption":
    sentinels = {tok.sentinel_id(i) for i in range(tok.num_sentinels)}
    assert sentinels & set(np.asarray(batch["encoder_inputs"]).ravel())


def test_train_tokenizer_command_trains_hf_kinds(tmp_path):
  """`experiments.train_tokenizer --config.data.tokenizer=hf` writes a loadable tokenizer.json."""
  import pathlib
  import subprocess
  import sys

  text = tmp_path / "corpus.txt"
  text.write_text("\n".join(f"the cat number {i} sat on the mat" for i in range(200)))
  root = pathlib.Path(__file__).resolve().parents[2]
  subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.train_tokenizer",
          "--config=configs/gpt.py:tiny",
          "--config.data.source=text_files",
          "--config.data.task=lm",
          f"--config.data.train_files={text}",
          "--config.data.tokenizer=hf",
          "--config.data.hf_model_type=wordpiece",
          "--config.data.vocab_size=80",
          f"--output={tmp_path / 'wp'}",
      ],
      cwd=root,
      check=True,
      capture_output=True,
  )
  file = tmp_path / "wp" / "tokenizer.json"
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
  ours = tokenizers.build_tokenizer(
      make_config(tokenizer="hf", tokenizer_path=str(tmp_path / "wp")).data
  )
  assert ours.encode("The cat sat") == theirs.encode("The cat sat", add_special_tokens=False)
  assert ours.decode(ours.encode("The cat sat")) == "the cat sat"  # BERT-style lower case
