"""Sources: TFDS (mocked and real Tiny Shakespeare), the Multi30k builder, TSV, bad input."""

import gzip

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tx_jax import data
from tx_jax.data import sources
from tests.data.helpers import make_config


def test_tfds_mock_lm_and_classification():
  with tfds.testing.mock_data(num_examples=12):
    lm = make_config(
        source="tfds",
        tfds_name="tiny_shakespeare",
        task="lm",
        seq_len=16,
        global_batch_size=2,
        pack=True,
    )
    b = next(data.build_train_iterator(lm, process_index=0, process_count=1))
    assert b["inputs"].shape == (2, 16) and (b["segment_ids"] > 0).any()
    cls = make_config(
        source="tfds",
        tfds_name="imdb_reviews",
        task="classification",
        seq_len=32,
        global_batch_size=4,
    )
    b = next(data.build_train_iterator(cls, process_index=0, process_count=1))
    assert b["labels"].shape == (4,) and b["labels"].dtype == np.int32
    assert (b["inputs"][:, 0] == 1).all() and b["token_type_ids"].max() == 0  # [CLS] first


def test_tfds_bad_name_and_key_name_the_field():
  with pytest.raises(ValueError, match="data.tfds_name='no_such_dataset_xyz'"):
    sources.build_source(make_config(source="tfds", tfds_name="no_such_dataset_xyz").data, "train")
  with tfds.testing.mock_data(num_examples=2):
    cfg = make_config(source="tfds", tfds_name="tiny_shakespeare", task="lm", text_key="body")
    with pytest.raises(KeyError, match="data.text_key='body'.*available: \\['text'\\]"):
      sources.build_source(cfg.data, "train")


def test_bad_values_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="data.seq_len=0"):
    data.build_train_iterator(make_config(task="lm", seq_len=0), process_index=0, process_count=1)
  with pytest.raises(ValueError, match="data.source_len=-1"):
    data.build_train_iterator(make_config(source_len=-1), process_index=0, process_count=1)
  with pytest.raises(ValueError, match="data.task='translate'"):
    data.validate(make_config(task="translate").data)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError, match="data.train_files.*empty"):
    sources.build_source(
        make_config(source="text_files", task="lm", train_files=str(empty)).data, "train"
    )
  with pytest.raises(FileNotFoundError, match="data.train_files.*matches no file"):
    sources.build_source(
        make_config(source="text_files", task="lm", train_files=str(tmp_path / "nope*.txt")).data,
        "train",
    )
  with pytest.raises(FileNotFoundError, match="data.manual_dir"):
    sources.build_source(make_config(source="multi30k", manual_dir=str(tmp_path)).data, "train")


def test_tsv_seq2seq_and_pair_classification(tmp_path):
  path = tmp_path / "pairs.tsv"
  path.write_text("de\ten\tlabel\nein Hund\ta dog\t1\nzwei Katzen\ttwo cats\t0\n", encoding="utf-8")
  cfg = make_config(source="tsv", train_files=str(path), eval_files=str(path))
  assert data.eval_examples(cfg, "validation") == [
      ("ein Hund", "a dog"),
      ("zwei Katzen", "two cats"),
  ]
  (batch,) = data.build_eval_batches(cfg, "validation", process_index=0, process_count=1)
  assert batch["weights"].sum() == len("a dog") + 1 + len("two cats") + 1
  cls = make_config(
      source="tsv",
      task="classification",
      eval_files=str(path),
      text_key="de",
      text_pair_key="en",
      seq_len=32,
      eval_global_batch_size=2,
  )
  (batch,) = data.build_eval_batches(cls, "validation", process_index=0, process_count=1)
  np.testing.assert_array_equal(batch["labels"], [1, 0])
  assert batch["token_type_ids"][0].sum() == len("a dog") + 1  # segment B and its [SEP]
  bad = make_config(source="tsv", train_files=str(path), source_key="fr")
  with pytest.raises(KeyError, match="data.source_key='fr'"):
    sources.build_source(bad.data, "train")


def _write_gz(path, lines):
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def test_multi30k_builder_from_manual_dir(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  for stem, n in (("train", 5), ("val", 3), ("test_2016_flickr", 2)):
    _write_gz(manual / f"{stem}.de.gz", [f"{stem} satz {i} Grüße" for i in range(n)])
    _write_gz(manual / f"{stem}.en.gz", [f"{stem} sentence {i}" for i in range(n)])
  cfg = make_config(source="multi30k", manual_dir=str(manual), tfds_data_dir=str(tmp_path / "tfds"))
  assert len(sources.build_source(cfg.data, "train")) == 5
  pairs = data.eval_examples(cfg, "test2016")
  assert pairs == [
      ("test_2016_flickr satz 0 Grüße", "test_2016_flickr sentence 0"),
      ("test_2016_flickr satz 1 Grüße", "test_2016_flickr sentence 1"),
  ]
  assert sorted(s for s, _ in data.eval_examples(cfg, "validation")) == [
      f"val satz {i} Grüße" for i in range(3)
  ]
  with pytest.raises(ValueError, match="split 'test'.*available"):
    sources.build_source(cfg.data, "test")


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def test_tiny_shakespeare_real_lm(data_dir, tfds_dir):
  """TFDS's own tiny_shakespeare builder, prepared offline from the shared file."""
  cfg = make_config(
      source="tfds",
      tfds_name="tiny_shakespeare",
      task="lm",
      seq_len=64,
      global_batch_size=4,
      manual_dir=str(data_dir / "tinyshakespeare"),
      tfds_data_dir=tfds_dir,
      eval_global_batch_size=32,
  )
  text = (data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  b = next(data.build_train_iterator(cfg, process_index=0, process_count=1))
  tok = data.build_tokenizer(cfg.data)
  for row, w in zip(b["inputs"], b["weights"]):
    assert tok.decode(row[w > 0]) in text  # a window of the real corpus
  evals = data.build_eval_batches(cfg, "validation", process_index=0, process_count=1)
  ((val_text, _),) = data.eval_examples(cfg, "validation")
  assert sum(b["weights"].sum() for b in evals) == len(tok.encode(val_text))  # all but the first


def test_multi30k_real_files(data_dir, tfds_dir):
  """The shared raw files: published sizes, and record i is line i of the .gz pair."""
  cfg = make_config(
      source="multi30k", manual_dir=str(data_dir / "multi30k"), tfds_data_dir=tfds_dir
  )
  sizes = {
      split: len(sources.build_source(cfg.data, split))
      for split in ("train", "validation", "test2016")
  }
  assert sizes == {"train": 29000, "validation": 1014, "test2016": 1000}
  with gzip.open(data_dir / "multi30k" / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
    de = f.read().splitlines()
  pairs = data.eval_examples(cfg, "test2016")
  assert [s for s, _ in pairs] == de


class _ManyAtOnce(list):
  """A record list that, like TFDS's array_record sources, also reads many indices at once."""

  def __init__(self, records):
    super().__init__(records)
    self.reads = []

  def __getitems__(self, indices):
    self.reads.append(len(indices))
    return [self[i] for i in indices]


@pytest.mark.parametrize("many_at_once", [False, True])
def test_iterating_a_keyed_source_yields_what_indexing_does(many_at_once):
  records = [{"de": f"satz {i}".encode(), "en": f"sentence {i}", "y": i % 3} for i in range(2500)]
  records = _ManyAtOnce(records) if many_at_once else records
  keyed = sources.KeyedSource(records, {"source": "de", "target": "en", "label": "y"})
  assert list(keyed) == [keyed[i] for i in range(len(keyed))]
  assert keyed[1234] == {"source": "satz 1234", "target": "sentence 1234", "label": 1}
  if many_at_once:  # in chunks, not one record at a time
    assert records.reads == [1024, 1024, 452]
