"""Loading a trainer workdir (decode/workdir.py), and experiments/decode.py end to end on one."""

import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import gpt, transformer
from tests.train import runs
from tx_jax import checkpoint, decode, models
from tx_jax.data.tokenizers import ByteTokenizer
from tx_jax.decode import workdir as wd
from tx_jax.train.state import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[2]
EOS = ByteTokenizer.eos_id


def shrink(config):
  m = config.model
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 2, 2, 2, 16, 64
  m.num_decoder_layers = 2 if m.family == "encdec" else 0
  m.max_len = 64
  return config


def write_workdir(path, config, example_inputs):
  """config.json + one Orbax checkpoint of a TrainState, as tx_jax.train writes them."""
  module = models.build(config.model)
  params = nn.meta.unbox(jax.jit(module.init)(jax.random.key(3), *example_inputs)["params"])
  params = jax.tree.map(lambda x: x * 3.0, params)  # sharper logits, no argmax ties
  tx = optax.adam(1e-3)
  state = TrainState(
      step=jnp.int32(7),
      params=params,
      opt_state=tx.init(params),
      rng=jax.random.PRNGKey(0),
      skipped=jnp.int32(0),
  )
  ckpt = checkpoint.Checkpointer(path / "checkpoints", config.checkpoint)
  ckpt.save(7, state)
  ckpt.close()
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  return module, params


def run_cli(*args, extra_env=None):
  env = runs.env(**(extra_env or {}))
  return subprocess.run(
      [sys.executable, "-m", "experiments.decode", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.fixture(scope="module")
def lm_workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("lm")
  module, params = write_workdir(
      path, shrink(gpt.get_config("tiny")), (jnp.zeros((1, 8), jnp.int32),)
  )
  return path, module, params


def test_load_restores_the_saved_params(lm_workdir):
  path, _, params = lm_workdir
  _, _, loaded, step = wd.load(path)
  assert step == 7
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


@pytest.mark.slow
def test_cli_prompt_ids_json_greedy_equals_the_library(lm_workdir):
  path, module, params = lm_workdir
  proc = run_cli(
      "--workdir",
      str(path),
      "--prompt_ids",
      "40,41,42",
      "--strategy",
      "greedy",
      "--max_new_tokens",
      "6",
      "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  out = decode.generate(
      module,
      params,
      decode.make_prompt([[40, 41, 42]], max_new_tokens=6),
      decode.Strategy("greedy", max_new_tokens=6),
      eos_id=EOS,
  )
  want = decode.strip_generated(np.asarray(out.tokens[0]), int(out.lengths[0]), EOS)
  assert record["tokens"] == want
  assert record["text"] == ByteTokenizer().decode(want)


@pytest.mark.slow
def test_cli_a_second_decode_loads_its_program_from_the_cache(lm_workdir, tmp_path):
  path, _, _ = lm_workdir
  cache = tmp_path / "cache"
  args = ["--workdir", str(path), "--prompt_ids", "40,41,42", "--strategy", "greedy", "--json",
          "--max_new_tokens", "6", f"--compilation_cache_dir={cache}"]
  extra = {
      # The session's cache (conftest) is replaced by an empty one the flag must override.
      "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env_cache"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the test model compiles fast
      "JAX_DEBUG_LOG_MODULES": "jax._src.compiler",  # logs each cache hit
  }
  first, second = [run_cli(*args, extra_env=extra) for _ in range(2)]
  assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:]
  assert any(p.name.startswith("jit__generate-") for p in cache.iterdir())
  assert "cache hit for 'jit__generate'" not in first.stderr
  assert "cache hit for 'jit__generate'" in second.stderr
  assert second.stdout == first.stdout


@pytest.mark.slow
def test_cli_translates_a_file_with_beam_search(tmp_path):
  config = shrink(transformer.get_config("tiny"))
  ids = jnp.zeros((1, 8), jnp.int32)
  write_workdir(tmp_path, config, (ids, ids))
  src = tmp_path / "src.txt"
  src.write_text("ein Hund\nzwei Katzen\nx\n", encoding="utf-8")
  out = tmp_path / "out.txt"
  proc = run_cli(
      "--workdir",
      str(tmp_path),
      "--input_file",
      str(src),
      "--output_file",
      str(out),
      "--max_new_tokens",
      "5",
      "--json",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  records = [json.loads(line) for line in proc.stdout.strip().splitlines()]
  assert [r["input"] for r in records] == ["ein Hund", "zwei Katzen", "x"]
  assert all(len(r["tokens"]) <= 5 for r in records)
  # split("\n"), not splitlines(): random outputs hold \x1e etc., which splitlines() splits on.
  want = [r["text"].replace("\r", " ").replace("\n", " ") for r in records]
  assert out.read_text(encoding="utf-8").split("\n")[:-1] == want


@pytest.mark.slow
def test_cli_bad_input_is_a_clear_error(lm_workdir):
  path, _, _ = lm_workdir
  proc = run_cli("--workdir", str(path), "--prompt", "", "--strategy", "greedy")
  assert proc.returncode == 2 and "--prompt='' is empty" in proc.stderr  # a usage error
  proc = run_cli("--workdir", str(path), "--prompt", "hi", "--top_p", "1.5")
  assert proc.returncode != 0 and "top_p=1.5 must lie in (0, 1]" in proc.stderr
