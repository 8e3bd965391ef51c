"""The README's Python snippets run as written (placeholders swapped for real local files)."""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _tiny_hf_gpt2(directory: pathlib.Path) -> pathlib.Path:
  """A small random GPT-2 saved as safetensors, standing in for a downloaded checkpoint."""
  transformers = pytest.importorskip("transformers")
  config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=97)
  transformers.GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
  return directory


def test_readme_has_python_snippets():
  assert len(SNIPPETS) >= 2, "the README's snippets were not found; update the pattern"


@pytest.mark.slow  # whole workflows (build and apply a model, decode, import HF weights): 8-12 s each
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path):
  code = SNIPPETS[index]
  namespace = {"__name__": f"readme_snippet_{index}"}
  if "path/to/hf_dir" in code:
    hf_dir = _tiny_hf_gpt2(tmp_path / "hf")
    code = code.replace("path/to/hf_dir", str(hf_dir)).replace('"out_dir"', repr(str(tmp_path / "out")))
    namespace["ids_BT"] = np.ones((2, 8), np.int32)
  exec(compile(code, f"README.md snippet {index}", "exec"), namespace)  # noqa: S102
