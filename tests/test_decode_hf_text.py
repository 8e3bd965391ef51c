"""`experiments.decode --prompt "text"` on converted HF models equals transformers end to end.

transformers tokenises, runs generate(do_sample=False) and decodes; tx_jax does the same from
a converted workdir (and from the HF directory itself) with the model's own tokenizer and
special ids. Ids and text must be equal. A T5 converted without a tokenizer decodes
--prompt_ids with its HF config's EOS and decoder start, and prints ids, never text.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from tests import hf_models
from tests.train import runs
from tx_jax import workdir as wd

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "KING HENRY: Once more unto the breach, dear friends — ünïcode 🎉"
N_NEW = 12


def decode_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "experiments.decode", *args],
      cwd=ROOT,
      env=runs.env(),
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.parametrize("source", ["converted", "hf_dir"])
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_decode_prompt_equals_transformers(family, source, tmp_path):
  model, tok = hf_models.save_model(family, tmp_path / "src")
  want_ids, want_text = hf_models.hf_generate(model, tok, PROMPT, N_NEW)
  directory = tmp_path / "src"
  if source == "converted":
    wd.import_hf(directory, tmp_path / "workdir")
    directory = tmp_path / "workdir"
  done = decode_cli(
      f"--workdir={directory}", f"--prompt={PROMPT}", "--strategy=greedy",
      f"--max_new_tokens={N_NEW}", "--json",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads(done.stdout.strip().splitlines()[-1])
  print(json.dumps({"family": family, "source": source, "hf": want_ids, "ours": record["tokens"]}))
  assert record["tokens"] == want_ids
  assert record["text"] == want_text


def test_t5_without_tokenizer_decodes_ids_with_hf_special_ids(tmp_path):
  model, _ = hf_models.save_model(
      "t5", tmp_path / "src", with_tokenizer=False, eos_token_id=3, decoder_start_token_id=5
  )
  wd.import_hf(tmp_path / "src", tmp_path / "workdir")
  source = [17, 40, 9, 250, 3]
  with torch.no_grad():
    out = model.generate(
        torch.tensor([source]), max_new_tokens=N_NEW, do_sample=False, num_beams=1
    )
  assert out[0, 0] == 5  # generate started from the HF decoder start
  want = hf_models.cut_at_eos(out[0, 1:].tolist(), 3)
  done = decode_cli(
      f"--workdir={tmp_path / 'workdir'}", f"--prompt_ids={','.join(map(str, source))}",
      "--strategy=greedy", f"--max_new_tokens={N_NEW}", "--json",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads(done.stdout.strip().splitlines()[-1])
  assert record["tokens"] == want and "text" not in record
  refused = decode_cli(f"--workdir={tmp_path / 'workdir'}", "--prompt=hello")
  assert refused.returncode != 0 and "--prompt_ids" in refused.stderr
