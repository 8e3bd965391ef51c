"""Bad inputs to train, decode, convert and train_tokenizer: one `error:` line, fast, no damage.

Every case asserts the exit code (2: usage / config, 1: run time), that the one error line
names the field or file, that no file under any checkpoints*/ directory (nor the run's
config.json) changed, and that it took under 30 s (no network wait: offline data fails at
once). Faults while saving and restoring (a full disk, a step missing its state) are rows
too: a damaged step that is set aside (exit 0) must arrive in checkpoints_damaged/ intact.
The cases run in one subprocess that forks per case after importing the libraries once
(tests/bad_input_runner.py), and three of them again as real `python -m` processes.

`python -m tests.test_bad_inputs` prints the table (case, exit code, message) as markdown.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import bad_input_runner
from tests.train import runs

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_SECONDS = 30

_T = ["--config=configs/gpt.py:tiny", "--workdir={ROOT}/new"]  # a valid train command
_TR = ["--config=configs/transformer.py:tiny", "--workdir={ROOT}/new"]
_RUN = "--workdir={ROOT}/run"  # the trained tiny Transformer (d_model 32)
_SMALL = [  # the shape the run was trained with
    "--config.model.num_layers=1", "--config.model.num_decoder_layers=1",
    "--config.model.num_heads=2", "--config.model.num_kv_heads=2", "--config.model.head_dim=16",
    "--config.model.mlp_dim=64", "--config.data.global_batch_size=8",
]  # fmt: skip


_TRAINED = bad_input_runner.TRAIN_FLAGS  # rerunning ROOT/run's own command


def case(id_, entry, args, code, *names, env=None, **extra):
  """`extra`: fail_save_of_step=N (that save fails as on a full disk, tests/disk_faults.py);
  moves=(FROM, TO): a damaged step set aside from FROM to TO, then saved again;
  one_line=True: stderr holds nothing but the message line."""
  return {"id": id_, "entry": entry, "args": list(args), "code": code, "names": names,
          "env": env or {}, **extra}  # fmt: skip


CASES = [
    # --- train: flags and config files ---
    case("unknown preset", "train", ["--config=configs/gpt.py:gpt5"], 2, "'gpt5'", "accepted"),
    case("missing config file", "train", ["--config=configs/nope.py"], 2, "configs/nope.py"),
    case("typo in a section", "train", [*_T, "--config.trian.steps=3"], 2, "--config.trian.steps"),
    case("typo in a field", "train", [*_T, "--config.train.stepz=3"], 2, "'stepz'", "steps"),
    case("not an int", "train", [*_T, "--config.train.steps=abc"], 2, "config.train.steps"),
    case("unknown flag", "train", [*_T, "--bogus"], 2, "bogus"),
    case("stray argument", "train", [*_T, "extra"], 2, "unexpected arguments", "extra"),
    case("seq_len > learned max_len", "train", [*_T, "--config.data.seq_len=512"], 2,
         "data.seq_len=512", "model.max_len=256"),
    case("source_len > sinusoidal max_len", "train", [*_TR, "--config.data.source_len=600"], 2,
         "data.source_len=600", "max_len=512"),
    case("vocab below the tokenizer's", "train", [*_T, "--config.model.vocab_size=200"], 2,
         "model.vocab_size=200", "260"),
    case("vocab below span sentinels", "train",
         ["--config=configs/t5.py:tiny", "--config.model.vocab_size=300"], 2,
         "model.vocab_size=300", "360"),
    case("best_metric the eval lacks", "train", [*_T, "--config.checkpoint.best_metric=eval_bleu"],
         2, "checkpoint.best_metric='eval_bleu'", "eval_loss"),
    case("decoder on a seq2seq task", "train", [*_T, "--config.data.task=seq2seq"], 2,
         "data.task='seq2seq'", "'decoder'"),
    case("encoder on an lm task", "train",
         ["--config=configs/bert.py:tiny", "--config.data.task=lm"], 2, "data.task='lm'", "'encoder'"),
    case("encoder without a head", "train", ["--config=configs/bert.py:tiny",
         "--config.model.head=none"], 2, "model.head"),
    case("mesh larger than the devices", "train", [*_T, "--config.mesh.data=3"], 2, "mesh"),
    case("batch vs grad accumulation", "train", [*_T, "--config.data.global_batch_size=10",
         "--config.train.grad_accum_steps=3"], 2, "grad_accum_steps=3"),
    case("zero steps", "train", [*_T, "--config.train.steps=0"], 2, "config.train.steps=0"),
    case("warm-up longer than the run", "train", [*_T, "--config.train.steps=3"], 2,
         "decay_steps", "warmup_steps=50"),
    case("unknown nonfinite policy", "train", [*_T, "--config.train.nonfinite=ignore"], 2,
         "train.nonfinite='ignore'"),
    case("unknown on_corrupt", "train", [*_T, "--config.checkpoint.on_corrupt=never"], 2,
         "checkpoint.on_corrupt='never'"),
    case("kv heads not dividing heads", "train", [*_T, "--config.model.num_kv_heads=3"], 2,
         "num_kv_heads=3"),
    case("unknown positions", "train", [*_T, "--config.model.positions=absolute"], 2,
         "positions='absolute'"),
    case("unknown optimizer", "train", [*_T, "--config.optimizer.name=sgd"], 2,
         "optimizer.name='sgd'"),
    case("negative learning rate", "train", [*_T, "--config.optimizer.learning_rate=-1"], 2,
         "optimizer.learning_rate=-1"),
    case("unknown data source", "train", [*_T, "--config.data.source=web"], 2,
         "data.source='web'"),
    case("text files: none given", "train", [*_T, "--config.data.source=text_files"], 2,
         "data.train_files"),
    case("text files: no match", "train", [*_T, "--config.data.source=text_files",
         "--config.data.train_files={ROOT}/absent*.txt"], 2, "data.train_files", "absent"),
    case("LoRA targets that match nothing", "train", [*_T, "--config.model.lora.rank=4",
         "--config.model.lora.targets=('nothing',)"], 2, "lora.targets", "'nothing'"),
    case("LoRA rank below zero", "train", [*_T, "--config.model.lora.rank=-1"], 2,
         "lora.rank=-1"),
    case("LoRA rank above the projection", "train", [*_T, "--config.model.lora.rank=4096",
         "--config.model.lora.targets=('qkv',)"], 2, "lora.rank=4096"),
    case("dry run of a bad model", "train", [*_T, "--dry_run", "--config.model.num_kv_heads=3"], 2,
         "num_kv_heads=3"),
    case("workdir config: invalid JSON", "train", ["--config=configs/workdir.py:{ROOT}/badjson"],
         2, "badjson/config.json", "not valid JSON"),
    case("workdir config: none", "train", ["--config=configs/workdir.py:{ROOT}/no_config"], 2,
         "no config.json"),
    case("offline Tiny Shakespeare absent", "train",
         ["--config=configs/gpt.py:tiny-shakespeare", "--workdir={ROOT}/new",
          "--config.data.tfds_data_dir={ROOT}/tfds"], 2, "TX_JAX_DATA_DIR", "data.manual_dir",
         env={"TX_JAX_DATA_DIR": "{ROOT}/empty_data_dir"}),
    case("unknown kernel set", "train", [*_T, "--config.model.kernels=mkl"], 2,
         "model.kernels='mkl'", "'plain', 'cpu'"),
    case("unknown context-parallel variant", "train", [*_T, "--config.model.context_parallel=ulysses"],
         2, "model.context_parallel='ulysses'", "'ring', 'all_gather'"),
    case("unknown causal load balance", "train",
         [*_T, "--config.model.context_load_balance=striped"], 2,
         "model.context_load_balance='striped'", "'data', 'attention', 'none'"),
    case("Multi30k without its vocabulary", "train", ["--config=configs/transformer.py:multi30k",
         "--config.data.spm_model_path={ROOT}/absent.model"], 2, "data.spm_model_path"),
    case("GPU attention on a CPU, trained workdir", "train", [*_TR, _RUN, *_SMALL,
         "--config.model.attention_backend=cudnn", "--config.model.dtype=bfloat16"], 2,
         "attention_backend='cudnn'", "needs an NVIDIA GPU"),
    case("compilation cache under a file, trained workdir", "train", [*_TR, _RUN, *_SMALL,
         "--config.model.d_model=32", "--compilation_cache_dir={ROOT}/badjson/config.json/xla"], 2,
         "--compilation_cache_dir=", "badjson/config.json/xla", "cannot create"),
    case("pallas without cross-attention", "train", [*_TR, "--config.model.attention_backend=pallas"],
         2, "attention_backend='pallas'", "cross-attention"),
    case("resume with another d_model", "train", [*_TR, _RUN, *_SMALL,
         "--config.model.d_model=64"], 2, "model.d_model=32, the config says 64"),
    case("checkpoint of another shape", "train", ["--config=configs/transformer.py:tiny",
         "--workdir={ROOT}/run_noconfig", *_SMALL, "--config.model.d_model=64"], 2,
         "does not match the config", "left in place"),
    case("edited data state, on_corrupt=stop", "train", ["--config=configs/transformer.py:tiny",
         "--workdir={ROOT}/run_edited", *_SMALL, "--config.model.d_model=32",
         "--config.checkpoint.on_corrupt=stop"], 1, "step 2", "data iterator state"),
    # --- train: faults while saving and restoring ---
    case("save onto a full disk", "train", [*_TRAINED, "--workdir={ROOT}/run_full"], 1,
         "could not save checkpoint step 2 in", "run_full/checkpoints/2",
         "No space left on device", "the last good checkpoint is step 1", fail_save_of_step=2,
         one_line=True),
    case("checkpoint missing its state, on_corrupt=stop", "train", [*_TRAINED,
         "--workdir={ROOT}/run_no_state_stop", "--config.checkpoint.on_corrupt=stop"], 1,
         "checkpoint step 2 at", "run_no_state_stop/checkpoints/2", "missing state/",
         "on_corrupt='stop'", one_line=True),
    case("checkpoint missing its state, on_corrupt=fallback", "train",
         [*_TRAINED, "--workdir={ROOT}/run_no_state"], 0, "checkpoint step 2 at",
         "missing state/", "falling back",
         moves=("run_no_state/checkpoints/2/", "run_no_state/checkpoints_damaged/2/"),
         one_line=True),
    # --- decode ---
    case("decode: no --workdir", "decode", ["--prompt=hi"], 2, "--workdir"),
    case("decode: workdir without config", "decode", ["--workdir={ROOT}/no_config", "--prompt=hi"],
         2, "no_config", "config.json"),
    case("decode: no input", "decode", [_RUN], 2, "--prompt", "--input_file"),
    case("decode: two inputs", "decode", [_RUN, "--prompt=a", "--prompt_ids=1"], 2, "exactly one"),
    case("decode: top_p > 1", "decode", [_RUN, "--prompt=hi", "--top_p=1.5"], 2, "top_p=1.5"),
    case("decode: compilation cache under a file", "decode", [_RUN, "--prompt=hi",
         "--compilation_cache_dir={ROOT}/badjson/config.json/xla"], 2,
         "--compilation_cache_dir=", "badjson/config.json/xla", "cannot create"),
    case("decode: top_p = 0", "decode", [_RUN, "--prompt=hi", "--top_p=0"], 2, "top_p=0.0"),
    case("decode: negative temperature", "decode", [_RUN, "--prompt=hi", "--temperature=-1"], 2,
         "temperature=-1.0"),
    case("decode: NaN temperature", "decode", [_RUN, "--prompt=hi", "--temperature=nan"], 2,
         "temperature=nan"),
    case("decode: temperature 0 sampling", "decode", [_RUN, "--prompt=hi", "--temperature=0",
         "--strategy=sample"], 2, "temperature=0.0", "greedy"),
    case("decode: negative top_k", "decode", [_RUN, "--prompt=hi", "--top_k=-1"], 2, "top_k=-1"),
    case("decode: beam_size 0", "decode", [_RUN, "--prompt=hi", "--beam_size=0"], 2,
         "beam_size=0"),
    case("decode: negative alpha", "decode", [_RUN, "--prompt=hi", "--alpha=-1"], 2, "alpha=-1.0"),
    case("decode: max_new_tokens 0", "decode", [_RUN, "--prompt=hi", "--max_new_tokens=0"], 2,
         "max_new_tokens=0"),
    case("decode: batch_size 0", "decode", [_RUN, "--prompt=hi", "--batch_size=0"], 2,
         "batch_size=0"),
    case("decode: unknown strategy", "decode", [_RUN, "--prompt=hi", "--strategy=top"], 2,
         "strategy"),
    case("decode: prompt id past the vocab", "decode", [_RUN, "--prompt_ids=5,99999",
         "--strategy=greedy"], 2, "--prompt_ids", "99999", "[0, 360)"),
    case("decode: negative prompt id", "decode", [_RUN, "--prompt_ids=-1", "--strategy=greedy"], 2,
         "--prompt_ids", "-1"),
    case("decode: prompt ids not ints", "decode", [_RUN, "--prompt_ids=a,b"], 2, "--prompt_ids"),
    case("decode: empty prompt", "decode", [_RUN, "--prompt=", "--strategy=greedy"], 2,
         "--prompt=''", "empty"),
    case("decode: empty input file", "decode", [_RUN, "--input_file={ROOT}/empty.txt"], 2,
         "empty.txt", "empty"),
    case("decode: missing input file", "decode", [_RUN, "--input_file={ROOT}/absent.txt"], 2,
         "absent.txt"),
    case("decode: blank line in input", "decode", [_RUN, "--input_file={ROOT}/blank_line.txt"], 2,
         "blank_line.txt", "line 2"),
    # --- convert ---
    case("convert: neither direction", "convert", [_RUN], 2, "--from_hf", "--to_hf",
         "--to_peft"),
    case("convert: both directions", "convert", [_RUN, "--from_hf={ROOT}/hf_gpt2",
         "--to_hf={ROOT}/out"], 2, "exactly one"),
    case("convert: no HF dir", "convert", ["--from_hf={ROOT}/absent", "--workdir={ROOT}/c1"], 2,
         "absent", "config.json"),
    case("convert: HF config invalid JSON", "convert", ["--from_hf={ROOT}/hf_badjson",
         "--workdir={ROOT}/c2"], 2, "hf_badjson/config.json", "not valid JSON"),
    case("convert: truncated safetensors", "convert", ["--from_hf={ROOT}/hf_truncated",
         "--workdir={ROOT}/c3"], 2, "hf_truncated/model.safetensors"),
    case("convert: config width vs weights", "convert", ["--from_hf={ROOT}/hf_wide",
         "--workdir={ROOT}/c4"], 2, "transformer.h.0", "attn"),
    case("convert: pickles only", "convert", ["--from_hf={ROOT}/hf_bin", "--workdir={ROOT}/c5"], 2,
         "pytorch_model.bin"),
    case("convert: into a trained workdir", "convert", ["--from_hf={ROOT}/hf_gpt2", _RUN], 2,
         "already holds checkpoints"),
    case("convert: preset task vs HF family", "convert", ["--from_hf={ROOT}/hf_gpt2",
         "--workdir={ROOT}/c6", "--config=configs/bert.py:tiny"], 2, "data.task='mlm'"),
    case("convert: to_hf without a workdir", "convert", ["--to_hf={ROOT}/out",
         "--workdir={ROOT}/no_config"], 2, "no_config", "config.json"),
    case("convert: PEFT adapter of another architecture", "convert", ["--from_hf={ROOT}/hf_gpt2",
         "--from_peft={ROOT}/peft_llama", "--workdir={ROOT}/c7"], 2, "q_proj",
         "another architecture"),
    case("convert: PEFT adapter of another shape", "convert", ["--from_hf={ROOT}/hf_gpt2",
         "--from_peft={ROOT}/peft_narrow", "--workdir={ROOT}/c8"], 2, "c_attn", "another shape"),
    case("convert: PEFT adapter of another base", "convert", ["--from_hf={ROOT}/hf_gpt2",
         "--from_peft={ROOT}/peft_other_base", "--workdir={ROOT}/c9"], 2,
         "base_model_name_or_path='/models/gpt2-xl'"),
    case("convert: from_peft without from_hf", "convert", [_RUN, "--to_hf={ROOT}/out",
         "--from_peft={ROOT}/peft_llama"], 2, "--from_peft needs --from_hf"),
    case("convert: to_peft without adapters", "convert", [_RUN, "--to_peft={ROOT}/out_peft"], 2,
         "lora.rank=0"),
    case("convert: LoRA to_hf without --merge", "convert", ["--workdir={ROOT}/lora_run",
         "--to_hf={ROOT}/out_lora"], 2, "--merge", "--to_peft"),
    # --- train_tokenizer ---
    case("tokenizer: no output path", "train_tokenizer", ["--config=configs/gpt.py:tiny"], 2,
         "--model_prefix"),
    case("tokenizer: tiny vocabulary", "train_tokenizer", ["--config=configs/gpt.py:tiny",
         "--model_prefix={ROOT}/spm", "--config.data.vocab_size=3"], 2, "data.vocab_size=3"),
]
# Run again as real `python -m` processes: the whole path, imports included.
SUBPROCESS_CASES = ("unknown preset", "seq_len > learned max_len", "decode: top_p > 1")


def error_line(output: str) -> str:
  lines = [line for line in output.splitlines() if line.startswith("error: ")]
  return lines[-1] if lines else ""


def message_line(spec: dict, result: dict) -> str:
  """The `error:` line; for a run that goes on (exit 0), the one stderr line that names the
  damaged step."""
  if spec["code"] != 0:
    return error_line(result["output"])
  lines = [line for line in result["stderr"].splitlines() if spec["names"][0] in line]
  return lines[-1] if lines else ""


def assert_set_aside_intact(result: dict, moves: tuple[str, str]) -> None:
  """Every file of FROM is under TO, unchanged; every other file is unchanged; only FROM
  (saved again by the run) and TO hold new files."""
  source, target = moves
  before, after = result["before"], result["after"]
  for path, digest in before.items():
    moved = target + path[len(source) :] if path.startswith(source) else path
    assert after.get(moved) == digest, (path, moved)
  new = [p for p in after if p not in before and not p.startswith((source, target))]
  assert not new, new


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("bad_inputs")
  subprocess.run(
      [sys.executable, "-m", "tests.bad_input_runner", "setup", str(root)],
      cwd=REPO, env=runs.env(), check=True, timeout=900, capture_output=True,
  )  # fmt: skip
  return root


@pytest.fixture(scope="module")
def results(fixtures) -> dict[str, dict]:
  env = runs.env()  # one device: the mesh cases rely on it
  proc = subprocess.run(
      [sys.executable, "-m", "tests.bad_input_runner", "run", str(fixtures)],
      input=json.dumps(CASES), cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  return {r["id"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_at_least_40_cases_over_train_decode_and_convert():
  entries = [c["entry"] for c in CASES]
  assert len(CASES) >= 40 and len({c["id"] for c in CASES}) == len(CASES)
  assert all(entries.count(e) >= 8 for e in ("train", "decode", "convert"))


@pytest.mark.slow
@pytest.mark.parametrize("spec", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(results, spec):
  result = results[spec["id"]]
  line = message_line(spec, result)
  assert result["rc"] == spec["code"], result["output"][-3000:]
  assert line, f"no 'error: ' line in:\n{result['output'][-3000:]}"
  assert "Traceback" not in result["output"], result["output"][-3000:]
  for name in spec["names"]:
    assert name in line, (name, line)
  if spec.get("moves"):
    assert_set_aside_intact(result, spec["moves"])
  else:  # a failed save's unfinished folder is no checkpoint (the next run removes it)
    changed = [c for c in result["changed"] if ".orbax-checkpoint-tmp" not in c]
    assert changed == [], changed
  if spec.get("one_line"):  # stderr holds that line and nothing else
    assert result["stderr"].strip().splitlines() == [line], result["stderr"][-3000:]
  assert result["seconds"] < MAX_SECONDS, result["seconds"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_as_a_process(fixtures, name):
  """The same error through `python -m experiments.<entry>`, imports and all, under 30 s."""
  import time  # pylint: disable=g-import-not-at-top

  spec = next(c for c in CASES if c["id"] == name)
  args = [a.replace("{ROOT}", str(fixtures)) for a in spec["args"]]
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "-m", f"experiments.{spec['entry']}", *args],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert time.monotonic() - start < MAX_SECONDS
  assert proc.returncode == spec["code"], proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
  assert all(n in proc.stderr for n in spec["names"])


def markdown_table(results: dict[str, dict]) -> str:
  """The closing note's table: case, exit code, message."""
  rows = ["| case | entry | exit | message |", "| --- | --- | --- | --- |"]
  for spec in CASES:
    r = results.get(spec["id"], {})
    message = message_line(spec, r).replace("|", "\\|") if r else ""
    rows.append(f"| {spec['id']} | {spec['entry']} | {r.get('rc')} | `{message}` |")
  return "\n".join(rows)


if __name__ == "__main__":
  import tempfile  # pylint: disable=g-import-not-at-top

  where = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
  if not (where / "run").is_dir():
    subprocess.run([sys.executable, "-m", "tests.bad_input_runner", "setup", str(where)], cwd=REPO,
                   check=True)  # fmt: skip
  out = subprocess.run(
      [sys.executable, "-m", "tests.bad_input_runner", "run", str(where)], input=json.dumps(CASES),
      cwd=REPO, capture_output=True, text=True, check=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
  )  # fmt: skip
  found = {r["id"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
  print(markdown_table(found))
  print("\nseconds: max %.1f" % max(r["seconds"] for r in found.values()))


@pytest.mark.parametrize("entry", ["train", "train_tokenizer"])
def test_typo_with_the_default_config_file_is_one_line(entry, tmp_path):
  """Without --config the default file is parsed when the flag is defined, at import time."""
  proc = subprocess.run(
      [sys.executable, "-m", f"experiments.{entry}", f"--workdir={tmp_path}", "--config.train.stepz=3"]
      if entry == "train"
      else [sys.executable, "-m", f"experiments.{entry}", "--config.data.vocab_sizee=3"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-2000:]
  assert proc.stderr.startswith("error: --config.") and "Did you mean" in proc.stderr
  assert not list(tmp_path.iterdir())  # nothing written
