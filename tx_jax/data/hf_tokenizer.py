"""HuggingFace `tokenizers` (Rust) tokenizers: any tokenizer.json, and training new ones.

Reads BPE (GPT-2's byte level, LLaMA-3's), SentencePiece-BPE (LLaMA-2), Unigram (T5) and
WordPiece (BERT) files with their normalizers, pre-tokenizers, post-processors and decoders.
`transformers` is not needed: special tokens come from the tokenizer_config.json /
special_tokens_map.json / config.json that sit beside tokenizer.json in an HF directory, else
from well-known token names, and any of them can be overridden from config.data.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tokenizers as tk

TOKENIZER_FILE = "tokenizer.json"
# Files an HF directory keeps beside tokenizer.json that say which token plays which role.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Well-known token names per role, used only when no side file names the role.
_KNOWN = {
    "bos": ("<s>", "<|begin_of_text|>", "[CLS]", "<|startoftext|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]", "<eos>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "mask": ("[MASK]", "<mask>"),
    "cls": ("[CLS]",),
    "sep": ("[SEP]",),
}
_HF_CONFIG_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id"}
_SENTINEL = re.compile(r"^<extra_id_(\d+)>$")
MODEL_KINDS = ("byte_bpe", "bpe", "unigram", "wordpiece")


def tokenizer_file(path: str | pathlib.Path) -> pathlib.Path:
  """The tokenizer.json that data.tokenizer_path names (the file, or a directory holding it)."""
  path = pathlib.Path(path)
  file = path / TOKENIZER_FILE if path.is_dir() else path
  if not file.is_file():
    raise FileNotFoundError(
        f"data.tokenizer_path={str(path)!r} is neither a tokenizer.json file nor a directory "
        "holding one; give an HF model directory or a file written by tokenizers' "
        "Tokenizer.save (python -m experiments.train_tokenizer --config.data.tokenizer=hf ...)"
    )
  return file


def _token_name(value: Any) -> str | None:
  """A side file's token entry: a string, or an AddedToken dict with its "content"."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class HFTokenizer:
  """A tokenizer.json plus its special ids; num_sentinels extra ids on top when it has none."""

  pad_id = 0  # batches pad with 0 under segment id 0, whatever the tokenizer calls padding

  def __init__(
      self,
      path: str | pathlib.Path,
      num_sentinels: int = 100,
      overrides: Mapping[str, int | None] | None = None,
  ):
    if num_sentinels < 0:
      raise ValueError(f"data.num_sentinels must be >= 0, got {num_sentinels}")
    self.path = str(tokenizer_file(path))
    self._tok = tk.Tokenizer.from_file(self.path)
    self._configure(num_sentinels, dict(overrides or {}))

  def _configure(self, num_sentinels: int, overrides: dict[str, int | None]) -> None:
    tok, folder = self._tok, pathlib.Path(self.path).parent
    vocab = tok.get_vocab(with_added_tokens=True)
    self.base_vocab_size = max(vocab.values()) + 1
    added = tok.get_added_tokens_decoder()
    self._special = frozenset(i for i, t in added.items() if t.special)
    named: dict[str, str | None] = {}
    sides = [folder / side for side in SIDE_FILES if (folder / side).is_file()]
    for side in sides:
      for key, value in _read_json(side).items():
        if key.endswith("_token") and _token_name(value) is not None:
          named.setdefault(key.removesuffix("_token"), _token_name(value))
    hf_config = _read_json(folder / "config.json")  # an HF model's; a tx_jax one names no ids
    ids: dict[str, int | None] = {}
    for role in _KNOWN:
      if named.get(role) is not None:
        ids[role] = tok.token_to_id(named[role])
      elif isinstance(hf_config.get(_HF_CONFIG_IDS.get(role, "")), int):
        ids[role] = hf_config[_HF_CONFIG_IDS[role]]
      elif not sides:  # a bare tokenizer.json: guess from names; side files are authoritative
        ids[role] = next((vocab[n] for n in _KNOWN[role] if n in vocab), None)
      else:
        ids[role] = None
    start = hf_config.get("decoder_start_token_id")
    ids["decoder_start"] = start if isinstance(start, int) else None
    ids.update({k.removesuffix("_id"): v for k, v in overrides.items() if v is not None})
    self.bos_id, self.eos_id, self.mask_id = ids["bos"], ids["eos"], ids["mask"]
    self.hf_pad_id = ids["pad"]
    self.unk_id = None
    self._cls_id, self._sep_id, self._start_id = ids["cls"], ids["sep"], ids["decoder_start"]
    if self.eos_id is None:
      raise ValueError(
          f"data.tokenizer_path={self.path!r} names no EOS token (no eos_token in "
          f"{' / '.join(SIDE_FILES)}, none of {_KNOWN['eos']}); set data.eos_id"
      )
    sentinels = {int(m.group(1)): i for t, i in vocab.items() if (m := _SENTINEL.match(t))}
    if sentinels:  # T5: <extra_id_k> are tokens of the vocabulary
      self.num_sentinels = len(sentinels)
      self._sentinels = [sentinels[k] for k in range(self.num_sentinels)]
      self.vocab_size = self.base_vocab_size
      self._virtual_sentinels = 0
    else:  # appended on top, as for the byte and SentencePiece tokenizers
      self.num_sentinels = num_sentinels
      self.vocab_size = self.base_vocab_size + num_sentinels
      self._sentinels = [self.vocab_size - 1 - k for k in range(num_sentinels)]
      self._virtual_sentinels = num_sentinels
    self._overrides, self._requested_sentinels = overrides, num_sentinels

  def __getstate__(self):
    # Pickled into grain worker processes: the JSON, not the Rust object.
    return {
        "json": self._tok.to_str(),
        "path": self.path,
        "num_sentinels": self._requested_sentinels,
        "overrides": self._overrides,
    }

  def __setstate__(self, state):
    self.path = state["path"]
    self._tok = tk.Tokenizer.from_str(state["json"])
    self._configure(state["num_sentinels"], state["overrides"])

  def encode(self, text: str) -> list[int]:
    """Text -> ids (no bos/eos added: the tasks add them)."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_input(self, text: str, *, encoder: bool) -> list[int]:
    """Text -> a model input as transformers builds it: the post-processor adds BOS / EOS.

    An encoder source always ends with EOS, as the seq2seq task trains it (T5's
    post-processor already appends it; GPT-2's byte-level one adds nothing).
    """
    if self._tok.post_processor is not None:
      ids = self._tok.encode(text, add_special_tokens=True).ids
    else:
      ids = self.encode(text)
    if encoder and (not ids or ids[-1] != self.eos_id):
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text; special tokens are skipped, appended sentinels rendered as <extra_id_i>.

    Ids past the tokenizer (a model vocabulary padded beyond it, as T5's) are skipped, as
    transformers skips them.
    """
    out, pending = [], []
    for i in (int(i) for i in ids):
      if self.base_vocab_size <= i < self.vocab_size:
        out.append(self._tok.decode(pending, skip_special_tokens=True))
        pending = []
        out.append(f"<extra_id_{self.vocab_size - 1 - i}>")
      else:
        pending.append(i)
    out.append(self._tok.decode(pending, skip_special_tokens=True))
    return "".join(out)

  def token(self, i: int) -> str | None:
    """The token string of id i (None past the tokenizer's vocabulary)."""
    return self._tok.id_to_token(i)

  @property
  def cls_id(self) -> int:
    """BERT [CLS]: the tokenizer's cls token, else bos, else eos."""
    return next(i for i in (self._cls_id, self.bos_id, self.eos_id) if i is not None)

  @property
  def sep_id(self) -> int:
    """BERT [SEP]: the tokenizer's sep token, else eos."""
    return self._sep_id if self._sep_id is not None else self.eos_id

  @property
  def decoder_start_id(self) -> int:
    """First decoder input: the HF config's decoder start, else bos, else pad (T5)."""
    return next(i for i in (self._start_id, self.bos_id, self.hf_pad_id, 0) if i is not None)

  @property
  def special_ids(self) -> frozenset[int]:
    """Special added tokens ([CLS], </s>, <pad>, sentinels...): never masked, never text."""
    return self._special | {i for i in (self.bos_id, self.eos_id, self.mask_id) if i is not None}

  def sentinel_id(self, i: int) -> int:
    """Sentinel i: the tokenizer's <extra_id_i>, else counting down from the top."""
    if not 0 <= i < self.num_sentinels:
      raise ValueError(f"sentinel index {i} outside [0, data.num_sentinels={self.num_sentinels})")
    return self._sentinels[i]

  def regular_ids(self) -> np.ndarray:
    """Ids an MLM random replacement may draw from: every non-special token."""
    special = self.special_ids | set(self._sentinels)
    return np.array([i for i in range(self.base_vocab_size) if i not in special], np.int32)


def build_trainable(kind: str, *, vocab_size: int, num_sentinels: int) -> tuple[Any, Any]:
  """(an untrained tokenizers.Tokenizer, its trainer) of one kind, with tx_jax's specials.

  byte_bpe is GPT-2's byte-level BPE; bpe is LLaMA-2's Metaspace BPE; unigram is T5's
  (with <extra_id_k> sentinels); wordpiece is BERT's. Id 0 is always padding.
  """
  from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

  if kind == "byte_bpe":
    specials = ["<pad>", "<|endoftext|>", "[MASK]"]
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
  elif kind == "bpe":
    specials = ["<pad>", "<s>", "</s>", "<unk>", "[MASK]"]
    tok = tk.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    trainer = trainers.BpeTrainer(  # the 256 <0xNN> byte tokens are added after training
        vocab_size=max(vocab_size - 256, len(specials) + 1),
        special_tokens=specials,
        show_progress=False,
    )
  elif kind == "unigram":
    specials = ["<pad>", "</s>", "<unk>", "[MASK]"]
    tok = tk.Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [normalizers.Replace(tk.Regex(" {2,}"), " "), normalizers.NFKC()]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size - num_sentinels,
        special_tokens=specials,
        unk_token="<unk>",
        show_progress=False,
    )
  elif kind == "wordpiece":
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = tk.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
  else:
    raise ValueError(f"data.hf_model_type={kind!r}; accepted: {', '.join(MODEL_KINDS)}")
  return tok, trainer


def _with_byte_tokens(tok: Any) -> Any:
  """LLaMA-2's layout: <0x00>..<0xFF> as vocabulary entries right after the specials.

  They must be model tokens, not added ones: byte fallback decodes them, and added special
  tokens would be skipped when decoding.
  """
  spec = json.loads(tok.to_str())
  vocab = spec["model"]["vocab"]
  specials = [t["content"] for t in spec["added_tokens"]]
  byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
  rest = [t for t in sorted(vocab, key=vocab.get) if t not in specials and t not in byte_tokens]
  spec["model"]["vocab"] = {t: i for i, t in enumerate(specials + byte_tokens + rest)}
  return tk.Tokenizer.from_str(json.dumps(spec))


def train_hf_tokenizer(
    texts: Iterable[str],
    path: str | pathlib.Path,
    *,
    kind: str,
    vocab_size: int,
    num_sentinels: int = 0,
) -> pathlib.Path:
  """Trains a tokenizers BPE / Unigram / WordPiece tokenizer and saves it as tokenizer.json.

  `path` is the file, or a directory that receives tokenizer.json. Unigram gets T5's
  <extra_id_k> sentinels (sentinel 0 is the last id); the other kinds get none.
  """
  tok, trainer = build_trainable(kind, vocab_size=vocab_size, num_sentinels=num_sentinels)

  def lines() -> Iterable[str]:
    for text in texts:
      yield from (line for line in text.splitlines() if line.strip())

  tok.train_from_iterator(lines(), trainer)
  if kind == "bpe":
    tok = _with_byte_tokens(tok)
  if kind == "unigram" and num_sentinels:
    tok.add_special_tokens([f"<extra_id_{k}>" for k in reversed(range(num_sentinels))])
  path = pathlib.Path(path)
  file = path / TOKENIZER_FILE if path.suffix != ".json" else path
  file.parent.mkdir(parents=True, exist_ok=True)
  tok.save(str(file))
  return file
