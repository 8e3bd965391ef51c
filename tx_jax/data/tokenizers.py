"""Tokenizers: UTF-8 bytes (default, nothing to download), SentencePiece and HF tokenizer.json.

Both share one id layout at the bottom (ARCHITECTURE.md): 0 pad, then eos / bos
/ mask, and T5-style sentinels counting down from the top of the vocabulary:
sentinel(0) == vocab_size - 1 ("<extra_id_0>"), sentinel(1) == vocab_size - 2...
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import ml_collections
import numpy as np
import sentencepiece as spm

from tx_jax.data.hf_tokenizer import HFTokenizer

KINDS = ("byte", "sentencepiece", "hf", "none")
# config.data fields that override a tokenizer's special ids (None: the tokenizer's own).
ID_FIELDS = ("bos_id", "eos_id", "pad_id", "decoder_start_id")

# SentencePiece pieces that play the BERT [MASK] role when a model has one.
_MASK_PIECES = ("[MASK]", "<mask>")


class ByteTokenizer:
  """UTF-8 bytes shifted past the special ids: pad 0, bos 1, eos 2, mask 3, bytes 4..259."""

  pad_id = 0
  bos_id = 1
  eos_id = 2
  mask_id = 3
  unk_id = None  # every string is representable as bytes
  _offset = 4

  def __init__(self, num_sentinels: int = 100):
    if num_sentinels < 0:
      raise ValueError(f"data.num_sentinels must be >= 0, got {num_sentinels}")
    self.num_sentinels = num_sentinels
    self.base_vocab_size = self._offset + 256
    self.vocab_size = self.base_vocab_size + num_sentinels

  def encode(self, text: str) -> list[int]:
    """Text -> ids (no bos/eos added)."""
    return (np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self._offset).tolist()

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text; special ids are dropped, sentinels rendered as <extra_id_i>."""
    out, pending = [], bytearray()
    for i in (int(i) for i in ids):
      if self._offset <= i < self.base_vocab_size:
        pending.append(i - self._offset)
        continue
      if i >= self.base_vocab_size:
        out.append(pending.decode("utf-8", errors="replace"))
        pending = bytearray()
        out.append(f"<extra_id_{self.vocab_size - 1 - i}>")
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)

  def encode_input(self, text: str, *, encoder: bool) -> list[int]:
    """Text -> a model input: an encoder source ends with EOS, as in training."""
    return self.encode(text) + ([self.eos_id] if encoder else [])

  @property
  def cls_id(self) -> int:
    """BERT [CLS]: the bos id (RoBERTa's <s> convention)."""
    return self.bos_id

  @property
  def sep_id(self) -> int:
    """BERT [SEP]: the eos id (RoBERTa's </s> convention)."""
    return self.eos_id

  @property
  def decoder_start_id(self) -> int:
    """First decoder input of a seq2seq target."""
    return self.bos_id

  @property
  def special_ids(self) -> frozenset[int]:
    """Ids that MLM never selects and span corruption never treats as text."""
    return frozenset(range(self._offset))

  def sentinel_id(self, i: int) -> int:
    """T5 sentinel i, counting down from the top of the vocabulary."""
    if not 0 <= i < self.num_sentinels:
      raise ValueError(f"sentinel index {i} outside [0, data.num_sentinels={self.num_sentinels})")
    return self.vocab_size - 1 - i

  def regular_ids(self) -> np.ndarray:
    """Ids an MLM random replacement may draw from (the 256 bytes)."""
    return np.arange(self._offset, self.base_vocab_size, dtype=np.int32)


class SentencePieceTokenizer:
  """A SentencePiece model (T5's included) plus num_sentinels extra ids on top."""

  def __init__(self, model_path: str, num_sentinels: int = 100):
    if not model_path or not os.path.isfile(model_path):
      raise FileNotFoundError(
          f"data.spm_model_path={model_path!r} is not a file; give a SentencePiece .model "
          "file or train one with `python -m experiments.train_tokenizer --config=...`"
      )
    if num_sentinels < 0:
      raise ValueError(f"data.num_sentinels must be >= 0, got {num_sentinels}")
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    if self._sp.pad_id() != 0:
      raise ValueError(
          f"data.spm_model_path={model_path!r} has pad id {self._sp.pad_id()}; tx_jax needs "
          "pad id 0 (train with pad_id=0, as T5's and experiments.train_tokenizer's models do)"
      )
    self.num_sentinels = num_sentinels
    self.base_vocab_size = self._sp.get_piece_size()
    self.vocab_size = self.base_vocab_size + num_sentinels
    self.pad_id = 0
    self.eos_id = self._sp.eos_id()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.unk_id = self._sp.unk_id()
    self.mask_id = next(
        (self._sp.piece_to_id(p) for p in _MASK_PIECES if self._sp.piece_to_id(p) != self.unk_id),
        None,
    )

  def __getstate__(self):
    # Pickled into grain worker processes: ship the model bytes, not the C++ object.
    return {
        "proto": self._sp.serialized_model_proto(),
        "num_sentinels": self.num_sentinels,
        "model_path": self.model_path,
        "mask_id": self.mask_id,
    }

  def __setstate__(self, state):
    self._sp = spm.SentencePieceProcessor(model_proto=state["proto"])
    self.model_path, self.num_sentinels = state["model_path"], state["num_sentinels"]
    self.base_vocab_size = self._sp.get_piece_size()
    self.vocab_size = self.base_vocab_size + self.num_sentinels
    self.pad_id, self.eos_id, self.unk_id = 0, self._sp.eos_id(), self._sp.unk_id()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.mask_id = state["mask_id"]

  def encode(self, text: str) -> list[int]:
    """Text -> ids (no bos/eos added)."""
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text; pad/bos/eos are dropped, sentinels rendered as <extra_id_i>."""
    out, pending = [], []
    drop = {self.pad_id, self.eos_id, self.bos_id}
    for i in (int(i) for i in ids):
      if i >= self.base_vocab_size:
        out.append(self._sp.decode(pending))
        pending = []
        out.append(f"<extra_id_{self.vocab_size - 1 - i}>")
      elif i not in drop:
        pending.append(i)
    out.append(self._sp.decode(pending))
    return "".join(out)

  def encode_input(self, text: str, *, encoder: bool) -> list[int]:
    """Text -> a model input: an encoder source ends with EOS, as in training."""
    return self.encode(text) + ([self.eos_id] if encoder else [])

  @property
  def cls_id(self) -> int:
    """BERT [CLS]: bos when the model has one, else eos."""
    return self.bos_id if self.bos_id is not None else self.eos_id

  @property
  def sep_id(self) -> int:
    """BERT [SEP]: the eos id."""
    return self.eos_id

  @property
  def decoder_start_id(self) -> int:
    """First decoder input: bos when the model has one, else pad (T5's convention)."""
    return self.bos_id if self.bos_id is not None else self.pad_id

  @property
  def special_ids(self) -> frozenset[int]:
    """Control, unknown and user-defined pieces (pad, eos, bos, unk, [MASK]...)."""
    return frozenset(
        i
        for i in range(self.base_vocab_size)
        if self._sp.is_control(i)
        or self._sp.is_unknown(i)
        or self._sp.id_to_piece(i) in _MASK_PIECES
    )

  def sentinel_id(self, i: int) -> int:
    """T5 sentinel i (<extra_id_i>), counting down from the top of the vocabulary."""
    if not 0 <= i < self.num_sentinels:
      raise ValueError(f"sentinel index {i} outside [0, data.num_sentinels={self.num_sentinels})")
    return self.vocab_size - 1 - i

  def regular_ids(self) -> np.ndarray:
    """Ids an MLM random replacement may draw from: every non-special piece."""
    special = self.special_ids
    return np.array([i for i in range(self.base_vocab_size) if i not in special], np.int32)


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HFTokenizer


def build_tokenizer(data_cfg: ml_collections.ConfigDict) -> Tokenizer:
  """The tokenizer named by data_cfg.tokenizer ("byte" | "sentencepiece" | "hf")."""
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer(num_sentinels=data_cfg.num_sentinels)
  if data_cfg.tokenizer == "sentencepiece":
    return SentencePieceTokenizer(data_cfg.spm_model_path, num_sentinels=data_cfg.num_sentinels)
  if data_cfg.tokenizer == "hf":
    overrides = {field: data_cfg[field] for field in ID_FIELDS}
    return HFTokenizer(data_cfg.tokenizer_path, data_cfg.num_sentinels, overrides)
  if data_cfg.tokenizer == "none":
    raise ValueError(
        "data.tokenizer='none': this model came without a tokenizer, so text cannot be "
        "tokenized; set data.tokenizer='hf' with data.tokenizer_path=<tokenizer.json or HF "
        "directory>, or 'sentencepiece' with data.spm_model_path (or decode with --prompt_ids)"
    )
  raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r}; accepted: {', '.join(KINDS)}")


def check_fits(tok: Tokenizer, model_vocab_size: int, *, with_sentinels: bool = True) -> None:
  """Raises unless every id the tokenizer emits (sentinels too, when used) is < model.vocab_size."""
  needed = tok.vocab_size if with_sentinels else tok.base_vocab_size
  if needed > model_vocab_size:
    what = type(tok).__name__ + (f" with {tok.num_sentinels} sentinels" if with_sentinels else "")
    raise ValueError(
        f"config.model.vocab_size={model_vocab_size} is smaller than the {needed} ids of the "
        f"tokenizer ({what}); ids >= {model_vocab_size} would have no embedding row (NaN "
        f"loss); set --config.model.vocab_size={needed} or use a smaller vocabulary"
    )


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    max_sentence_bytes: int = 4096,
) -> str:
  """Trains a SentencePiece model with tx_jax's id layout; returns the .model path.

  Long documents are fed line by line (SentencePiece skips sentences longer
  than max_sentence_length); pad 0, eos 1, bos 2, unk 3, [MASK] 4.
  """
  if vocab_size <= 5:
    raise ValueError(f"data.vocab_size must exceed the 5 special pieces, got {vocab_size}")

  def lines() -> Iterable[str]:
    for text in texts:
      for line in text.splitlines():
        line = line.strip()
        if line:
          yield line[:max_sentence_bytes]

  os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=lines(),
      model_prefix=model_prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=0,
      eos_id=1,
      bos_id=2,
      unk_id=3,
      user_defined_symbols=["[MASK]"],
      character_coverage=1.0,
      max_sentence_length=max_sentence_bytes * 4,
      hard_vocab_limit=False,
      minloglevel=2,
  )
  return model_prefix + ".model"
