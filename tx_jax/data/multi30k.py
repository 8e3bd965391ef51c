"""Multi30k task 1 (German-English image captions) as a TFDS builder.

Online it downloads the raw files from the multi30k/dataset GitHub repository;
offline, `download_config.manual_dir` (config `data.manual_dir`) holds the same
six .gz files, e.g. `$TX_JAX_DATA_DIR/multi30k` (see data/README.md).
"""

from __future__ import annotations

import gzip
import os

import tensorflow_datasets as tfds

_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
# TFDS split name -> raw file stem.
_SPLITS = {"train": "train", "validation": "val", "test2016": "test_2016_flickr"}
RAW_FILES = tuple(f"{stem}.{lang}.gz" for stem in _SPLITS.values() for lang in ("de", "en"))


def _read_lines(path: str) -> list[str]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return [line.rstrip("\n") for line in f]


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """Multi30k task 1: 29,000 / 1,014 / 1,000 de-en sentence pairs (raw, untokenized)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Raw task-1 files; splits train / validation / test2016."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Optional (used when offline): place train/val/test_2016_flickr .de.gz and .en.gz from "
      "https://github.com/multi30k/dataset/tree/master/data/task1/raw in manual_dir."
  )

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description="Multi30k task 1 German-English translation of Flickr30k captions.",
        features=tfds.features.FeaturesDict(
            {"de": tfds.features.Text(), "en": tfds.features.Text()}
        ),
        supervised_keys=("de", "en"),
        disable_shuffling=True,  # record i is line i of the raw files, as published
        homepage="https://github.com/multi30k/dataset",
    )

  def _manual_files(self, dl_manager) -> dict[str, str] | None:
    """The six raw files from manual_dir, or None when it is unset or lacks one."""
    try:
      manual_dir = os.fspath(dl_manager.manual_dir)
    except (AssertionError, ValueError):  # TFDS's ways of saying 'no manual dir'
      return None
    paths = {n: os.path.join(manual_dir, n) for n in RAW_FILES}
    return paths if all(os.path.isfile(p) for p in paths.values()) else None

  def _split_generators(self, dl_manager):
    files = self._manual_files(dl_manager)
    if files is None:
      # Keep the .gz as is: _read_lines decompresses, so the cached file matches the manual one.
      downloaded = dl_manager.download({n: _URL + n for n in RAW_FILES})
      files = {n: os.fspath(p) for n, p in downloaded.items()}
    return {
        split: self._generate_examples(files[f"{stem}.de.gz"], files[f"{stem}.en.gz"])
        for split, stem in _SPLITS.items()
    }

  def _generate_examples(self, de_path: str, en_path: str):
    de, en = _read_lines(de_path), _read_lines(en_path)
    if len(de) != len(en):
      raise ValueError(f"Multi30k: {de_path} has {len(de)} lines but {en_path} has {len(en)}")
    for i, (d, e) in enumerate(zip(de, en)):
      yield i, {"de": d, "en": e}
