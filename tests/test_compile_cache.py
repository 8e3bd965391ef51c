"""tx_jax.compile_cache: which directory `experiments.train` uses, bad paths, and a re-run
that loads its programs from the cache and computes bit-identical losses."""

import os

import jax
import pytest

from tests.train import runs
from tx_jax import compile_cache


@pytest.fixture
def environment_chose_nothing():
  """JAX's cache settings as in a shell with no JAX_* variables (conftest sets a folder)."""
  saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_enable_compilation_cache", True)
  yield
  jax.config.update("jax_compilation_cache_dir", saved[0])
  jax.config.update("jax_enable_compilation_cache", saved[1])


def test_default_is_under_xdg_cache_home(environment_chose_nothing, tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.resolve(None) == tmp_path / "tx_jax" / "xla"
  assert (tmp_path / "tx_jax" / "xla").is_dir()


def test_the_environments_choice_stands(environment_chose_nothing, tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
  assert compile_cache.resolve(None) is None
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_enable_compilation_cache", False)  # JAX_ENABLE_COMPILATION_CACHE=false
  assert compile_cache.resolve(None) is None
  assert not (tmp_path / "tx_jax").exists()


def test_an_explicit_folder_wins_and_an_empty_flag_turns_it_off(tmp_path):
  assert compile_cache.resolve(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
  assert compile_cache.resolve("") is None


def test_a_path_that_cannot_be_a_folder_is_named(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  with pytest.raises(ValueError, match=r"--compilation_cache_dir='.*file/xla': cannot create"):
    compile_cache.resolve(str(blocker / "xla"))


def test_an_unusable_default_folder_only_turns_the_cache_off(
    environment_chose_nothing, tmp_path, monkeypatch, capsys
):
  (tmp_path / "file").write_text("not a folder")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
  assert compile_cache.resolve(None) is None
  assert "note: no compilation cache: " in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_folder_is_named(tmp_path):
  folder = tmp_path / "ro"
  folder.mkdir()
  folder.chmod(0o500)
  try:
    with pytest.raises(
        ValueError, match=r"--compilation_cache_dir='.*ro': the directory is not writable"
    ):
      compile_cache.resolve(str(folder))
  finally:
    folder.chmod(0o700)


@pytest.mark.slow
def test_a_rerun_loads_its_programs_and_computes_the_same_losses(tmp_path):
  """Two fresh workdirs, one cache: the second run's train step comes from the cache."""
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  cache = tmp_path / "cache"
  logs = []
  for name in ("first", "second"):
    flags = runs.tiny_gpt_flags(corpus, tmp_path / name, steps=6)
    flags.append(f"--compilation_cache_dir={cache}")
    # The session's cache (conftest) is replaced by an empty one the flag must override.
    extra = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env_cache")}
    extra["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler"  # logs each cache hit
    done = runs.run(flags, extra_env=extra)
    assert done.returncode == 0, done.stderr[-3000:]
    logs.append(done.stderr)
  assert any(p.name.startswith("jit_train_step-") for p in cache.iterdir())
  assert "cache hit for 'jit_train_step'" not in logs[0]
  assert "cache hit for 'jit_train_step'" in logs[1]
  first, second = runs.losses(tmp_path / "first"), runs.losses(tmp_path / "second")
  assert sorted(first) == list(range(1, 7))
  assert second == first
