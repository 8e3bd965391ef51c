"""Random-access record sources: TFDS (any name), Multi30k, local text / TSV files, synthetic.

Every source is a sequence (`len`, `__getitem__`) of plain dicts with the
standard keys the tasks read: "text" (+ "text_pair", "label") or
"source" / "target". grain reads them in a seeded order.
"""

from __future__ import annotations

import csv
import glob
import os
import random
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import pathlib

import ml_collections

SOURCES = ("synthetic", "tfds", "multi30k", "text_files", "tsv")


def _as_str(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _task_keys(data_cfg: ml_collections.ConfigDict) -> dict[str, str]:
  """Standard record key -> configured feature key, for the configured task."""
  if data_cfg.task == "seq2seq":
    return {"source": "source_key", "target": "target_key"}
  keys = {"text": "text_key"}
  if data_cfg.task == "classification":
    keys["label"] = "label_key"
    if data_cfg.text_pair_key:
      keys["text_pair"] = "text_pair_key"
  return keys


class KeyedSource(Sequence):
  """Renames the features of a random-access source to the standard record keys."""

  def __init__(self, records: Sequence[dict], keys: dict[str, str]):
    self._records = records
    self._keys = keys  # standard key -> feature key

  def __len__(self) -> int:
    return len(self._records)

  def __iter__(self):
    # Sequence's default iterates until IndexError; array_record raises ValueError instead.
    # A source that reads many records at once (TFDS's array_record sources) is read in
    # chunks, because each single read pays a fixed Python cost per record.
    read_many = getattr(self._records, "__getitems__", None)
    if read_many is None:
      return (self[i] for i in range(len(self)))
    return self._iter_chunks(read_many)

  def _iter_chunks(self, read_many, chunk: int = 1024):
    for start in range(0, len(self), chunk):
      for record in read_many(list(range(start, min(start + chunk, len(self))))):
        yield self._rename(record)

  def __getitem__(self, index: int) -> dict:
    return self._rename(self._records[index])

  def _rename(self, record: dict) -> dict:
    out = {k: _as_str(record[f]) for k, f in self._keys.items() if k != "label"}
    if "label" in self._keys:
      out["label"] = int(record[self._keys["label"]])
    return out


class FeatureKeyError(KeyError, ValueError):
  """A data.*_key names no feature of the source: a config error (a KeyError for old callers)."""

  __str__ = Exception.__str__


def _check_features(data_cfg, available: Sequence[str], what: str) -> dict[str, str]:
  """Maps standard keys to feature names, failing with the config field that names a missing one."""
  keys = {}
  for std, field in _task_keys(data_cfg).items():
    name = data_cfg[field]
    if name not in available:
      raise FeatureKeyError(
          f"data.{field}={name!r} is not a feature of {what}; available: {sorted(available)}"
      )
    keys[std] = name
  return keys


def _prepare_once(builder, download_config) -> None:
  """Prepares a TFDS data set under a file lock: parallel runs (a sweep) otherwise race to
  rename the same incomplete directory into place, and all but one fail."""
  import fcntl  # pylint: disable=g-import-not-at-top

  lock_dir = pathlib.Path(builder.data_dir_root)  # not data_dir: its existence means "prepared"
  lock_dir.mkdir(parents=True, exist_ok=True)
  with open(lock_dir / f".{builder.name}.prepare.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not builder.is_prepared():  # another process may have prepared it while we waited
      builder.download_and_prepare(file_format="array_record", download_config=download_config)


def tfds_source(data_cfg: ml_collections.ConfigDict, split: str, builder=None) -> KeyedSource:
  """Any TFDS data set through tfds.data_source (prepared as array_record when missing)."""
  import tensorflow_datasets as tfds  # slow import: only when a TFDS source is used

  if builder is None:
    if not data_cfg.tfds_name:
      raise ValueError("data.tfds_name is empty; set a TFDS name such as 'tiny_shakespeare'")
    try:
      builder = tfds.builder(
          data_cfg.tfds_name, data_dir=data_cfg.tfds_data_dir, file_format="array_record"
      )
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(
          f"data.tfds_name={data_cfg.tfds_name!r} is not a TFDS data set "
          f"({str(e).splitlines()[0]})"
      ) from e
  features = builder.info.features
  keys = _check_features(data_cfg, list(features.keys()), f"TFDS {builder.name!r}")
  if not builder.is_prepared():
    check_manual_dir(data_cfg, builder.name, str(builder.data_path))
    _prepare_once(builder, tfds.download.DownloadConfig(manual_dir=data_cfg.manual_dir))
  known = list(builder.info.splits.keys())
  base = split.split("[")[0]
  if known and base not in known:
    raise ValueError(
        f"split {split!r} (data.train_split / train.eval_split) is not a split of "
        f"{builder.name!r}; available: {sorted(known)}"
    )
  return KeyedSource(builder.as_data_source(split=split), keys)


# Raw files TFDS reads from manual_dir instead of downloading them, per data set, and where
# to get them.
MANUAL_FILES = {"tiny_shakespeare": ("input.txt",)}
MANUAL_SOURCES = {
    "tiny_shakespeare": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
    "tinyshakespeare/input.txt"
}


def check_manual_dir(data_cfg: ml_collections.ConfigDict, name: str, prepared_at: str) -> None:
  """Fails at once when an unprepared data set's manual_dir lacks its files.

  Without this, TFDS would fall back to downloading and, offline, spend minutes in retries.
  """
  manual_dir = data_cfg.manual_dir
  if not manual_dir:
    return
  needed = MANUAL_FILES.get(name.split("/")[0], ())
  present = os.listdir(manual_dir) if os.path.isdir(manual_dir) else []
  missing = [f for f in needed if f not in present] if needed else ([] if present else ["any"])
  if not missing:
    return
  what = "does not exist" if not os.path.isdir(manual_dir) else f"lacks {missing}"
  source = MANUAL_SOURCES.get(name.split("/")[0])
  raise MissingDataError(
      f"data.manual_dir={manual_dir!r} {what}, and TFDS {name!r} is not prepared in "
      f"{prepared_at}; point TX_JAX_DATA_DIR (read when the config is built) at the folder "
      f"holding the offline data sets, or --config.data.manual_dir at the raw files"
      + (f" (from {source})" if source else "")
  )


class MissingDataError(FileNotFoundError):
  """A local data set is absent; the message names the directory and the variable to set."""


def multi30k_source(data_cfg: ml_collections.ConfigDict, split: str) -> KeyedSource:
  """tx_jax's Multi30k de-en TFDS builder (manual_dir: the raw .gz files)."""
  from tx_jax.data import multi30k

  if data_cfg.manual_dir:
    missing = [
        n for n in multi30k.RAW_FILES if not os.path.isfile(os.path.join(data_cfg.manual_dir, n))
    ]
    if missing:
      raise MissingDataError(
          f"data.manual_dir={data_cfg.manual_dir!r} lacks Multi30k files "
          f"{missing}; it needs {list(multi30k.RAW_FILES)} (point TX_JAX_DATA_DIR at the "
          "folder holding multi30k/, or set --config.data.manual_dir)"
      )
  builder = multi30k.Multi30k(data_dir=data_cfg.tfds_data_dir, file_format="array_record")
  return tfds_source(data_cfg, split, builder=builder)


def _expand_files(pattern_list: str, field: str) -> list[str]:
  if not pattern_list:
    raise ValueError(f"data.{field} is empty; give comma-separated file globs")
  paths = []
  for pattern in pattern_list.split(","):
    matched = sorted(glob.glob(os.path.expanduser(pattern.strip())))
    if not matched:
      raise FileNotFoundError(f"data.{field}: {pattern.strip()!r} matches no file")
    paths.extend(matched)
  for path in paths:
    if os.path.getsize(path) == 0:
      raise ValueError(f"data.{field}: {path!r} is empty")
  return paths


def _files_field(split: str, train_split: str) -> str:
  return "train_files" if split == train_split else "eval_files"


class TextFileSource(KeyedSource):
  """Local UTF-8 text files: one example per non-empty line, or per file."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str):
    field = _files_field(split, data_cfg.train_split)
    if data_cfg.task in ("seq2seq", "classification"):
      raise ValueError(
          f"data.source='text_files' gives plain text; data.task={data_cfg.task!r} "
          "needs columns: use data.source='tsv'"
      )
    if data_cfg.text_files_document not in ("line", "file"):
      raise ValueError(
          f"data.text_files_document={data_cfg.text_files_document!r}; " "accepted: 'line', 'file'"
      )
    texts = []
    for path in _expand_files(data_cfg[field], field):
      with open(path, encoding="utf-8") as f:
        if data_cfg.text_files_document == "file":
          texts.append(f.read())
        else:
          texts.extend(line.rstrip("\n") for line in f if line.strip())
    if not texts:
      raise ValueError(f"data.{field}={data_cfg[field]!r} holds no text")
    super().__init__([{"text": t} for t in texts], {"text": "text"})


class TsvSource(KeyedSource):
  """Local tab-separated files whose header row names the columns the feature keys pick."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str):
    field = _files_field(split, data_cfg.train_split)
    rows, keys = [], None
    for path in _expand_files(data_cfg[field], field):
      with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        file_keys = _check_features(data_cfg, reader.fieldnames or [], f"TSV header of {path!r}")
        keys = keys or file_keys
        rows.extend(reader)
    if not rows:
      raise ValueError(f"data.{field}={data_cfg[field]!r} has a header but no rows")
    super().__init__(rows, keys)


class SyntheticSource(Sequence):
  """Reverse (or copy) a random string; held-out strings are disjoint from train by crc32.

  Example i of a split is a pure function of (synthetic_seed, split, i). A string
  is held out when crc32(string) % 100 < synthetic_heldout_percent: the train
  split rejects those strings and the held-out splits accept only them.
  """

  SPLITS = {"train": 0, "validation": 1, "test": 2}

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str):
    if split not in self.SPLITS:
      raise ValueError(
          f"synthetic split {split!r} (data.train_split / train.eval_split); "
          f"accepted: {sorted(self.SPLITS)}"
      )
    if data_cfg.synthetic_task not in ("reverse", "copy"):
      raise ValueError(
          f"data.synthetic_task={data_cfg.synthetic_task!r}; " "accepted: 'reverse', 'copy'"
      )
    if not 1 <= data_cfg.synthetic_min_len <= data_cfg.synthetic_max_len:
      raise ValueError(
          f"data.synthetic_min_len={data_cfg.synthetic_min_len} and "
          f"data.synthetic_max_len={data_cfg.synthetic_max_len} need 1 <= min <= max"
      )
    if not 0 < data_cfg.synthetic_heldout_percent < 100:
      raise ValueError(
          f"data.synthetic_heldout_percent={data_cfg.synthetic_heldout_percent}; " "accepted: 1..99"
      )
    if not data_cfg.synthetic_alphabet:
      raise ValueError("data.synthetic_alphabet is empty")
    self._cfg = data_cfg
    self._split = self.SPLITS[split]
    self._size = data_cfg.synthetic_train_size if split == "train" else data_cfg.synthetic_eval_size
    if self._size <= 0:
      raise ValueError(
          f"synthetic split {split!r} has size {self._size}; set "
          "data.synthetic_train_size / data.synthetic_eval_size > 0"
      )
    self._alphabet = data_cfg.synthetic_alphabet

  def __len__(self) -> int:
    return self._size

  def _held_out(self, s: str) -> bool:
    return zlib.crc32(s.encode("utf-8")) % 100 < self._cfg.synthetic_heldout_percent

  def string(self, index: int) -> str:
    """The source string of example `index` (rejection-sampled into its split's hash bucket)."""
    if not 0 <= index < self._size:
      raise IndexError(f"synthetic index {index} outside [0, {self._size})")
    # Python's Mersenne Twister seeded by an int is stable across versions and ~20x cheaper
    # to create than a numpy Generator, which matters at thousands of examples a second.
    rng = random.Random((self._cfg.synthetic_seed * 4 + self._split) * 2**40 + index)
    lo, hi, alphabet = self._cfg.synthetic_min_len, self._cfg.synthetic_max_len, self._alphabet
    want_held_out = self._split != 0
    while True:
      s = "".join(rng.choices(alphabet, k=rng.randint(lo, hi)))
      if self._held_out(s) == want_held_out:
        return s

  def __getitem__(self, index: int) -> dict:
    s = self.string(index)
    target = s[::-1] if self._cfg.synthetic_task == "reverse" else s
    # "text"/"label" let the lm / mlm / classification tasks smoke-test on it too.
    return {"source": s, "target": target, "text": f"{s}={target}", "label": int(s[0] <= s[-1])}


def build_source(data_cfg: ml_collections.ConfigDict, split: str) -> Sequence[dict]:
  """The configured source's records for `split`, as a random-access sequence of dicts."""
  if data_cfg.source == "synthetic":
    return SyntheticSource(data_cfg, split)
  if data_cfg.source == "tfds":
    return tfds_source(data_cfg, split)
  if data_cfg.source == "multi30k":
    return multi30k_source(data_cfg, split)
  if data_cfg.source == "text_files":
    return TextFileSource(data_cfg, split)
  if data_cfg.source == "tsv":
    return TsvSource(data_cfg, split)
  raise ValueError(f"data.source={data_cfg.source!r}; accepted: {', '.join(SOURCES)}")


def texts(data_cfg: ml_collections.ConfigDict, split: str) -> Iterator[str]:
  """Every text of a split, whatever the task reads (tokenizer training input)."""
  for record in build_source(data_cfg, split):
    for key in ("text", "text_pair", "source", "target"):
      if key in record:
        yield record[key]
