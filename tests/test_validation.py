"""tx_jax.validation and tx_jax.cli in-process: the fast tier of tests/test_bad_inputs.py."""

import json
import subprocess
import sys

from absl import app
import pytest

from configs import bert, gpt, t5, transformer
from tx_jax import checkpoint, cli, validation


@pytest.mark.parametrize(
    "make,overrides,match",
    [
        (gpt.get_config, {"data.seq_len": 512}, r"data.seq_len=512 .*max_len=256"),
        (transformer.get_config, {"data.target_len": 513}, r"data.target_len=513"),
        (gpt.get_config, {"model.vocab_size": 259}, r"vocab_size=259 .* 260 ids"),
        (t5.get_config, {"model.vocab_size": 359}, r"vocab_size=359 .* 360 ids"),
        (gpt.get_config, {"data.task": "mlm"}, r"data.task='mlm' .*'decoder'"),
        (bert.get_config, {"data.task": "span_corruption"}, r"data.task='span_corruption'"),
        (transformer.get_config, {"data.task": "lm"}, r"data.task='lm' .*'encdec'"),
        (bert.get_config, {"model.head": "classification"}, r"needs config.model.head='mlm'"),
        (gpt.get_config, {"checkpoint.best_metric": "eval_bleu"}, r"best_metric='eval_bleu'"),
        (
            transformer.get_config,
            {"checkpoint.best_metric": "eval_bits_per_byte"},
            r"eval_exact_match",
        ),
        (gpt.get_config, {"mesh.data": 3}, r"config.mesh"),
        (gpt.get_config, {"train.steps": 0}, r"train.steps=0"),
        (gpt.get_config, {"checkpoint.keep": 0}, r"checkpoint.keep=0"),
        # Backends' limits, before the workdir is written (they used to fail at trace time).
        (gpt.get_config, {"model.attention_backend": "cudnn"}, r"dtype='float32'"),
        (
            gpt.get_config,
            {"model.attention_backend": "cudnn", "model.dtype": "bfloat16"},
            r"attention_backend='cudnn' needs an NVIDIA GPU, but JAX runs on 'cpu'",
        ),
        (gpt.get_config, {"model.attention_backend": "pallas"}, r"'pallas' needs an NVIDIA GPU"),
        (t5.get_config, {"model.attention_backend": "pallas"}, r"positions='relative'"),
        (transformer.get_config, {"model.attention_backend": "pallas"}, r"cross-attention"),
        (
            gpt.get_config,  # packed rows: cuDNN would need a [T, S] mask
            {"data.pack": True, "model.attention_backend": "cudnn", "model.dtype": "bfloat16"},
            r"packed_inputs=True \(config.data.pack=True\).*'pallas'",
        ),
        (gpt.get_config, {"model.attention_backend": "splash"}, r"'splash' needs a TPU"),
        (t5.get_config, {"model.attention_backend": "splash"}, r"positions='relative'"),
        (
            gpt.get_config,
            {"model.attention_backend": "blockwise", "model.attention_dropout_rate": 0.1},
            r"'blockwise' has no attention dropout.*attention_dropout_rate=0.1",
        ),
    ],
)
def test_train_config_names_the_field(make, overrides, match):
  config = make("tiny")
  for path, value in overrides.items():
    section, field = path.split(".")
    config[section][field] = value
  with pytest.raises(ValueError, match=match):
    validation.train_config(config, num_devices=1, num_processes=1)


def test_a_backend_whose_kernel_this_jax_lacks_is_refused(monkeypatch):
  from tx_jax.layers.attention import backends

  monkeypatch.setitem(backends.KERNEL_MODULES, "pallas", "jax.experimental.no_such_kernel")
  config = gpt.get_config("tiny")
  config.model.attention_backend = "pallas"
  with pytest.raises(ValueError, match=r"needs jax.experimental.no_such_kernel, which jax"):
    validation.attention_backend_runs_here(config, "gpu")


def test_packed_inputs_follow_data_pack():
  """The attention's promise of unpacked rows is the data pipeline's own flag."""
  config = gpt.get_config("tiny")
  assert not config.data.pack and not config.model.packed_inputs
  config.data.pack = True
  assert config.model.packed_inputs
  assert transformer.get_config("multi30k").model.packed_inputs  # its preset packs


def test_lengths_are_free_for_relative_and_rope_positions():
  config = t5.get_config("tiny")
  config.data.source_len = 4096  # relative positions have no table
  validation.lengths_fit(config)
  config = gpt.get_config("llama-tiny")
  config.data.seq_len = 4096
  validation.lengths_fit(config)


def test_eval_metric_names_follow_the_task():
  assert validation.eval_metric_names(gpt.get_config("tiny")) == [
      "eval_loss",
      "eval_accuracy",
      "eval_bits_per_byte",
  ]
  assert "eval_exact_match" in validation.eval_metric_names(transformer.get_config("tiny"))


@pytest.mark.parametrize(
    "flags,match",
    [
        (dict(top_p=1.5), r"--top_p=1.5"),
        (dict(top_p=float("nan")), r"--top_p=nan"),
        (dict(temperature=float("inf")), r"--temperature=inf"),
        (dict(temperature=0.0, strategy="sample"), r"use --strategy=greedy"),
        (dict(top_k=-2), r"--top_k=-2"),
        (dict(beam_size=0), r"--beam_size=0"),
        (dict(alpha=float("nan")), r"--alpha=nan"),
        (dict(max_new_tokens=0), r"--max_new_tokens=0"),
        (dict(batch_size=-1), r"--batch_size=-1"),
        (dict(strategy="nucleus"), r"--strategy='nucleus'"),
    ],
)
def test_decode_flags_name_the_flag(flags, match):
  values = dict(
      strategy="greedy",
      max_new_tokens=8,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      beam_size=4,
      alpha=0.6,
      batch_size=4,
      input_file=None,
  )
  values.update(flags)
  with pytest.raises(ValueError, match=match.replace("[", r"\[")):
    validation.decode_flags(**values)


def test_temperature_zero_is_accepted_for_greedy():
  validation.decode_flags(
      strategy="greedy",
      max_new_tokens=1,
      temperature=0.0,
      top_k=0,
      top_p=1.0,
      beam_size=1,
      alpha=0.0,
      batch_size=1,
      input_file=None,
  )


def test_prompt_ids_within_the_vocabulary():
  assert validation.prompt_ids("1, 2,3", 4) == [1, 2, 3]
  for text, match in (("1,4", r"\[4\] outside .*\[0, 4\)"), ("-1", r"\[-1\]"), ("", "no id")):
    with pytest.raises(ValueError, match=match):
      validation.prompt_ids(text, 4)


def test_workdir_with_another_model_is_refused_before_anything(tmp_path):
  config = gpt.get_config("tiny")
  saved = gpt.get_config("tiny")
  saved.model.d_model = 256
  (tmp_path / "config.json").write_text(saved.to_json())
  (tmp_path / "checkpoints" / "20").mkdir(parents=True)
  with pytest.raises(ValueError, match=r"model.d_model=256, the config says 128"):
    validation.workdir_matches(config, tmp_path)
  config.model.dropout_rate = 0.3  # not a shape: resuming with another dropout is fine
  config.model.d_model = 256
  validation.workdir_matches(config, tmp_path)


def test_exit_codes():
  assert cli.exit_code(ValueError("x")) == cli.USAGE
  assert cli.exit_code(FileNotFoundError("x")) == cli.USAGE
  assert cli.exit_code(app.UsageError("x")) == cli.USAGE
  assert cli.exit_code(checkpoint.CheckpointError("x")) == cli.FAILURE
  assert cli.exit_code(checkpoint.CheckpointMismatchError("x")) == cli.USAGE
  assert cli.exit_code(RuntimeError("x")) == cli.FAILURE
  assert cli.exit_code(KeyError("x")) == cli.FAILURE


def test_one_line_flattens_messages():
  assert cli.one_line(ValueError("a\n  b")) == "a; b"
  assert cli.one_line(KeyError("no field 'x'")) == "KeyError: no field 'x'"  # not ours: typed
  assert cli.one_line(checkpoint.CheckpointError("bad")) == "bad"


def test_guarded_main_prints_one_line_and_returns_the_code(capsys):
  def main(argv):
    del argv
    raise ValueError("config.model.d_model=-1 must be > 0")

  assert cli.guarded(main)(["prog"]) == 2
  err = capsys.readouterr().err
  assert err == "error: config.model.d_model=-1 must be > 0\n"


def test_verbose_prints_the_traceback():
  code = (
      "import sys; from tx_jax import cli\n"
      "def main(argv): raise RuntimeError('boom')\n"
      "cli.run(main)\n"
  )
  quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  loud = subprocess.run([sys.executable, "-c", code, "--verbose"], capture_output=True, text=True)
  assert quiet.returncode == loud.returncode == 1
  assert "Traceback" not in quiet.stderr and quiet.stderr.startswith("error: RuntimeError: boom")
  assert "Traceback" in loud.stderr and "error: RuntimeError: boom" in loud.stderr


def test_data_fingerprint_is_canonical():
  a = checkpoint.data_fingerprint({"b": [1, 2], "a": 1})
  assert a == checkpoint.data_fingerprint(json.loads('{"a": 1, "b": [1, 2]}'))
  assert a != checkpoint.data_fingerprint({"b": [1, 3], "a": 1})
