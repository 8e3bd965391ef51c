"""A real full disk (a small tmpfs, so root only): one error line, exit 1, then a resume.

tests/train/test_failed_save.py and the test_bad_inputs rows inject the same failure on any
machine; this one lets TensorStore itself run out of space, as in issue 52's report.
"""

import hashlib
import os
import re
import shutil
import subprocess

import pytest

from tests.train import runs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"),
        reason="mounting a tmpfs needs root",
    ),
]
ROOMY = 256 << 20


def _mount(path, size: int, remount: bool = False) -> bool:
  options = f"{'remount,' if remount else ''}size={size}"
  command = ["mount", "-o", options, str(path)] if remount else [
      "mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]  # fmt: skip
  return subprocess.run(command, capture_output=True).returncode == 0


@pytest.fixture
def disk(tmp_path):
  path = tmp_path / "disk"
  path.mkdir()
  if not _mount(path, ROOMY):
    pytest.skip("cannot mount a tmpfs here (a container without CAP_SYS_ADMIN)")
  yield path
  subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _hashes(step_dir):
  return {
      str(p.relative_to(step_dir)): hashlib.sha1(p.read_bytes()).hexdigest()
      for p in sorted(step_dir.rglob("*"))
      if p.is_file()
  }


def test_a_full_disk_stops_with_one_line_and_the_rerun_resumes_bitwise(tmp_path, disk):
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  workdir = disk / "run"
  first = runs.run(runs.tiny_gpt_flags(corpus, workdir, steps=10))
  assert first.returncode == 0, first.stderr[-3000:]
  used = shutil.disk_usage(disk).used
  committed = _hashes(workdir / "checkpoints" / "10")
  files = (workdir / "checkpoints").rglob("*")
  checkpoint_bytes = sum(p.stat().st_size for p in files if p.is_file())
  # Room for one more checkpoint (step 20), not for two.
  assert _mount(disk, used + int(1.6 * checkpoint_bytes) + (1 << 20), remount=True)

  failed = runs.run(runs.tiny_gpt_flags(corpus, workdir, steps=60))
  assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-3000:]
  lines = failed.stderr.strip().splitlines()
  assert len(lines) == 1, failed.stderr[-3000:]
  found = re.fullmatch(
      r"error: could not save checkpoint step (\d+) in (\S+): No space left on device; the "
      r"last good checkpoint is step (\d+)\. Free space .* \(Orbax's worker-thread "
      r"tracebacks: (\S+)\)",
      lines[0],
  )
  assert found, lines[0]
  step, where, last_good, log = int(found[1]), found[2], int(found[3]), found[4]
  assert where == str(workdir / "checkpoints" / str(step)) and last_good == step - 10
  assert os.path.isfile(log)
  assert not list((workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
  assert _hashes(workdir / "checkpoints" / "10") == committed  # unchanged by the failure
  trained = runs.losses(workdir)  # the failed run's steps, logged before it stopped
  assert max(trained) < 60

  assert _mount(disk, ROOMY, remount=True)  # space freed
  rerun = runs.run(runs.tiny_gpt_flags(corpus, workdir, steps=60))
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"resumed from step {last_good}" in rerun.stdout
  assert "error" not in rerun.stderr and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
  resumed = runs.losses(workdir)  # the last line of each step: the rerun's
  redone = [s for s in trained if s > last_good]
  assert redone and all(resumed[s] == trained[s] for s in redone)  # bitwise
