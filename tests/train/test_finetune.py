"""The BERT sentence-classification preset fine-tunes end to end on mock glue/sst2."""

import json

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import bert
from tx_jax import data, models
from tx_jax.decode import workdir as workdir_lib
from tx_jax.train import loop

pytestmark = pytest.mark.slow


def _accuracy_by_hand(config, params) -> float:
  """Accuracy of the final params on the eval split: argmax vs label over real rows, in numpy."""
  module = models.build(config.model)
  hits = total = 0.0
  for batch in data.build_eval_batches(config, config.train.eval_split):
    args, kwargs = models.model_inputs(config.model, batch)
    logits = np.asarray(module.apply({"params": params}, *args, **kwargs, train=False))
    assert logits.shape == (len(batch["labels"]), config.model.num_classes)
    weights = np.asarray(batch["weights"], np.float64)
    hits += float(np.sum(weights * (logits.argmax(-1) == batch["labels"])))
    total += float(np.sum(weights))
  return hits / total


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
    params, step = workdir_lib.restore_params(tmp_path / "checkpoints", config.model)
    expected = _accuracy_by_hand(config, jax.device_get(params))
  assert result["step"] == step == 4
  # The trainer's eval_accuracy is the final model's accuracy on the eval split, exactly.
  assert result["eval_accuracy"] == pytest.approx(expected, abs=1e-6)
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [2, 4]
