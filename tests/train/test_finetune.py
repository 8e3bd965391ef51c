"""The BERT sentence-classification preset fine-tunes end to end on mock glue/sst2."""

import json

import pytest
import tensorflow_datasets as tfds

from configs import bert
from tx_jax.train import loop

pytestmark = pytest.mark.slow


def test_bert_sst2_preset_trains_on_mock_data(tmp_path):
  config = bert.get_config("tiny-sst2")
  assert (config.data.tfds_name, config.data.task, config.model.head) == (
      "glue/sst2",
      "classification",
      "classification",
  )
  config.model.num_layers, config.data.seq_len = 1, 16
  config.data.global_batch_size = config.data.eval_global_batch_size = 8
  config.train.steps, config.train.eval_every, config.train.log_every = 4, 0, 2
  config.train.progress, config.train.plot, config.schedule.warmup_steps = "log", False, 1
  with tfds.testing.mock_data(num_examples=16):
    result = loop.train_and_evaluate(config, tmp_path)
  assert result["step"] == 4
  assert 0.0 <= result["eval_accuracy"] <= 1.0
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [2, 4]
