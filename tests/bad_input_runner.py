"""Runs experiments/* entry points on bad inputs, for tests/test_bad_inputs.py.

  python -m tests.bad_input_runner setup ROOT         # workdirs, HF dirs and files to break
  python -m tests.bad_input_runner run ROOT < cases   # JSON cases in, JSON results out

`run` imports the heavy libraries once, then forks one child per case that runs
`python -m experiments.<entry> <args>` in-process (runpy, as `-m` does; its stdout and stderr
in separate files), so a case costs
its own work, not ~5 s of imports. The parent never initialises a JAX backend, so the
children may. Every file under a `checkpoints*` directory of ROOT, and the config.json
beside it, is hashed before and after each case; a result lists the files that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

CASE_TIMEOUT_S = 120  # a hung case is killed; the test asserts far less (30 s)
# The tiny Transformer `setup` trains in ROOT/run (2 steps, a checkpoint at each); a case
# that reruns it with these flags (and --workdir) writes the same config.json.
TRAIN_FLAGS = [
    "--config=configs/transformer.py:tiny", "--config.model.d_model=32",
    "--config.model.num_layers=1", "--config.model.num_decoder_layers=1",
    "--config.model.num_heads=2", "--config.model.num_kv_heads=2", "--config.model.head_dim=16",
    "--config.model.mlp_dim=64", "--config.train.steps=2", "--config.checkpoint.every=1",
    "--config.train.eval_every=0", "--config.train.eval_batches=1",
    "--config.train.decode_examples=4", "--config.train.print_examples=0",
    "--config.train.plot=false", "--config.train.progress=log",
    "--config.schedule.warmup_steps=1", "--config.data.global_batch_size=8",
    "--config.data.eval_global_batch_size=8",
]  # fmt: skip


def snapshot(root: pathlib.Path) -> dict[str, str]:
  """sha1 of every file below any checkpoints* directory of root, and of the config.json
  beside it (the run's record of its config, which a refused command must not rewrite)."""
  out = {}
  for directory in root.rglob("checkpoints*"):
    if directory.is_dir():
      paths = [p for p in directory.rglob("*") if p.is_file()]
      paths += [p for p in [directory.parent / "config.json"] if p.is_file()]
      for path in paths:
        out[str(path.relative_to(root))] = hashlib.sha1(path.read_bytes()).hexdigest()
  return out


def _child(case: dict, root: pathlib.Path, log: pathlib.Path) -> None:
  import runpy  # pylint: disable=g-import-not-at-top

  code = 99
  try:
    os.environ.update({k: v.replace("{ROOT}", str(root)) for k, v in case.get("env", {}).items()})
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(os.open(f"{log}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    args = [a.replace("{ROOT}", str(root)) for a in case["args"]]
    if case.get("fail_save_of_step"):  # a full disk at that step's save (tests/disk_faults.py)
      from tests import disk_faults  # pylint: disable=g-import-not-at-top

      disk_faults.install(case["fail_save_of_step"])
    sys.argv = [f"experiments/{case['entry']}.py", *args]
    try:
      runpy.run_module(f"experiments.{case['entry']}", run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # noqa: BLE001 -- a traceback escaped the entry point: the test fails
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    code = 98
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(root: pathlib.Path, cases: list[dict]) -> list[dict]:
  """Each case's exit code, output, seconds and changed checkpoint files."""
  # The libraries every entry point imports; no backend is initialised here.
  import grain  # noqa: F401 pylint: disable=g-import-not-at-top,unused-import
  import jax  # noqa: F401 pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint  # noqa: F401 pylint: disable=g-import-not-at-top,unused-import

  from tx_jax import cli, hf, validation  # noqa: F401 pylint: disable=g-import-not-at-top
  from tx_jax.decode import workdir  # noqa: F401 pylint: disable=g-import-not-at-top
  from tx_jax.train import loop  # noqa: F401 pylint: disable=g-import-not-at-top

  logs = root / "logs"
  logs.mkdir(exist_ok=True)
  results = []
  for case in cases:
    log = logs / f"{case['id']}.txt"
    before = snapshot(root)
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
      _child(case, root, log)
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        rc = os.waitstatus_to_exitcode(status)
        break
      if time.monotonic() - start > CASE_TIMEOUT_S:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        rc = -9
        break
      time.sleep(0.02)
    seconds = time.monotonic() - start
    after = snapshot(root)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    stderr = logs / f"{case['id']}.txt.stderr"
    results.append(
        {"id": case["id"], "rc": rc, "stderr": stderr.read_text(errors="replace"),
         "output": log.read_text(errors="replace") + stderr.read_text(errors="replace"),
         "seconds": seconds, "changed": changed}
    )  # fmt: skip
    if case.get("moves"):  # the test checks where each file went
      results[-1].update(before=before, after=after)
  return results


def setup(root: pathlib.Path) -> None:
  """A trained tiny Transformer workdir, broken copies of it, HF dirs and input files."""
  import subprocess  # pylint: disable=g-import-not-at-top

  root.mkdir(parents=True, exist_ok=True)
  run_dir = root / "run"
  train = [sys.executable, "-m", "experiments.train", *TRAIN_FLAGS, f"--workdir={run_dir}"]
  subprocess.run(train, check=True, capture_output=True, timeout=600)

  shutil.copytree(run_dir / "checkpoints", root / "run_noconfig" / "checkpoints")
  for name in ("run_no_state", "run_no_state_stop"):  # the newest step lost its state/
    shutil.copytree(run_dir, root / name)
    shutil.rmtree(root / name / "checkpoints" / "2" / "state")
  shutil.copytree(run_dir, root / "run_full")  # step 2 to be saved again, onto a "full disk"
  shutil.rmtree(root / "run_full" / "checkpoints" / "2")
  shutil.copytree(run_dir, root / "run_edited")
  data_file = root / "run_edited" / "checkpoints" / "2" / "data" / "process_0-of-1.json"
  state = json.loads(data_file.read_text())
  state["next_index"] = int(state.get("next_index", 0)) + 5  # valid, at another position
  data_file.write_text(json.dumps(state))

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from configs import gpt  # pylint: disable=g-import-not-at-top
  from tx_jax import hf, models  # pylint: disable=g-import-not-at-top

  config = gpt.get_config("tiny")
  m = config.model
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 1, 2, 2, 16, 64
  m.max_len = 64
  module = models.build(m)
  params = module.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), train=False)["params"]
  hf_dir = root / "hf_gpt2"
  hf.to_pretrained(config, params, hf_dir)
  shutil.copytree(hf_dir, root / "hf_truncated")
  weights = root / "hf_truncated" / "model.safetensors"
  os.truncate(weights, weights.stat().st_size // 2)
  shutil.copytree(hf_dir, root / "hf_wide")
  values = json.loads((root / "hf_wide" / "config.json").read_text())
  values["n_embd"] = 48  # the weights are 32 wide
  (root / "hf_wide" / "config.json").write_text(json.dumps(values))
  (root / "hf_bin").mkdir()
  (root / "hf_bin" / "config.json").write_text((hf_dir / "config.json").read_text())
  (root / "hf_bin" / "pytorch_model.bin").write_bytes(b"not unpickled")
  _peft_dirs(root, hf_dir)
  (root / "hf_badjson").mkdir()
  (root / "hf_badjson" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"],')
  (root / "badjson").mkdir()
  (root / "badjson" / "config.json").write_text("{bad json")
  (root / "no_config").mkdir()
  (root / "empty_data_dir").mkdir()
  (root / "empty.txt").write_text("")
  (root / "blank_line.txt").write_text("ein Hund\n\nzwei Katzen\n")
  (root / "input.txt").write_text("ein Hund\n")


def _peft_dirs(root: pathlib.Path, hf_dir: pathlib.Path) -> None:
  """PEFT adapters that do not fit hf_gpt2 (d_model 32, one layer), written without PEFT, and a
  LoRA workdir converted from it."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  from configs import common  # pylint: disable=g-import-not-at-top
  from tx_jax import workdir  # pylint: disable=g-import-not-at-top

  def adapter(name, module, a_shape, b_shape, base=None):
    (root / name).mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": [module],
              "base_model_name_or_path": base}  # fmt: skip
    (root / name / "adapter_config.json").write_text(json.dumps(config))
    prefix = f"base_model.model.{module}"
    save_file(
        {f"{prefix}.lora_A.weight": np.ones(a_shape, np.float32),
         f"{prefix}.lora_B.weight": np.ones(b_shape, np.float32)},
        str(root / name / "adapter_model.safetensors"),
    )  # fmt: skip

  adapter("peft_llama", "model.layers.0.self_attn.q_proj", (2, 32), (32, 2))
  adapter("peft_narrow", "transformer.h.0.attn.c_attn", (2, 24), (72, 2))
  adapter("peft_other_base", "transformer.h.0.attn.c_attn", (2, 32), (96, 2), "/models/gpt2-xl")
  config = common.base_config()
  config.model.lora.update(rank=2, targets=("qkv",))
  workdir.import_hf(hf_dir, root / "lora_run", config)


if __name__ == "__main__":
  command, where = sys.argv[1], pathlib.Path(sys.argv[2])
  if command == "setup":
    setup(where)
  else:
    json.dump(run(where, json.load(sys.stdin)), sys.stdout)
