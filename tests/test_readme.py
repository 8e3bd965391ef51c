"""The README's Python snippets run as written, and each one's result is asserted.

A snippet whose introducing line ends with "continuing:" runs after the one before it, in
one namespace. Most snippets carry their
own `assert`; CHECKS asserts on what the others define. Placeholders (a HuggingFace
directory, its output, `ids_BT`) are swapped for real local files and arrays.
"""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# (the line before the snippet, the snippet)
_BLOCKS = re.findall(r"([^\n]*)\n\n```python\n(.*?)```", README.read_text(), re.S)
SNIPPETS = [code for _, code in _BLOCKS]
CONTINUES = [intro.rstrip().endswith("continuing:") for intro, _ in _BLOCKS]


def _check_sweep(namespace):
  runs = []
  namespace["sweep"](lambda overrides=None, **kw: runs.append({**(overrides or {}), **kw}))
  assert runs == [
      {"optimizer.learning_rate": lr, "seed": seed} for lr in (1e-3, 3e-3) for seed in (0, 1)
  ]


# Snippets without an `assert` of their own: a line that identifies each, and its check.
CHECKS = {"def sweep(add):": _check_sweep}

# What a snippet raises while a feature it shows is still on its way (the plain-JAX models:
# no custom VJPs, AttentionSpec.explicit_mask). Delete an entry once that work has landed.


def _chain(index: int) -> list[int]:
  """The snippets to run, in order, for snippet `index`: back to the last fresh one."""
  start = index
  while start > 0 and CONTINUES[start]:
    start -= 1
  return list(range(start, index + 1))


def _tiny_hf_gpt2(directory: pathlib.Path) -> pathlib.Path:
  """A small random GPT-2 saved as safetensors, standing in for a downloaded checkpoint."""
  transformers = pytest.importorskip("transformers")
  config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=97)
  transformers.GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
  return directory


def test_readme_has_python_snippets():
  assert len(SNIPPETS) >= 6, "the README's snippets were not found; update the pattern"
  missed = README.read_text().count("```python") - len(SNIPPETS)
  assert missed == 0, "a snippet without a blank line before it"
  assert not CONTINUES[0], "the first snippet cannot continue another"


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_every_snippet_asserts_its_result(index):
  code = SNIPPETS[index]
  assert "assert " in code or any(key in code for key in CHECKS), (
      f"README snippet {index} asserts nothing; add an `assert` or an entry in CHECKS:\n{code}"
  )


@pytest.mark.slow  # whole workflows: build and apply a model, decode, import HF weights
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path):
  namespace = {"__name__": f"readme_snippet_{index}"}
  for i in _chain(index):
    code = SNIPPETS[i]
    if "path/to/hf_dir" in code:
      hf_dir = _tiny_hf_gpt2(tmp_path / "hf")
      code = code.replace("path/to/hf_dir", str(hf_dir))
      code = code.replace('"out_dir"', repr(str(tmp_path / "out")))
      namespace["ids_BT"] = np.ones((2, 8), np.int32)
    exec(compile(code, f"README.md snippet {i}", "exec"), namespace)  # noqa: S102
  for key, check in CHECKS.items():
    if key in SNIPPETS[index]:
      check(namespace)
