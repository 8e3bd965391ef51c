"""MetricWriter: metrics.jsonl and TensorBoard scalars, written without importing torch."""

import json
import pathlib
import struct
import subprocess
import sys

import pytest

_WRITE_AND_REPORT = """
import json, sys, pathlib
from tx_jax.train import metrics
workdir = pathlib.Path(sys.argv[1])
writer = metrics.MetricWriter(workdir, start_step=0)
writer.write(1, {"loss": 2.5, "note": "text is not a scalar"})
writer.write(2, {"loss": 1.25})
writer.close()
torch_after_writer = "torch" in sys.modules
import torch  # still importable: the writer hid it only while tensorboardX loaded
print(json.dumps({"torch_after_writer": torch_after_writer, "torch": torch.__version__}))
"""


def _tfrecords(path: pathlib.Path) -> list[bytes]:
  """The payloads of a TFRecord file: [u64 length][u32 crc][payload][u32 crc] each."""
  data, records, offset = path.read_bytes(), [], 0
  while offset < len(data):
    (length,) = struct.unpack_from("<Q", data, offset)
    records.append(data[offset + 12 : offset + 12 + length])
    offset += 12 + length + 4
  return records


def _scalars(event_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  found: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(event_dir.glob("events.out.tfevents.*")):
    for record in _tfrecords(path):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        found.setdefault(value.tag, []).append((event.step, value.simple_value))
  return found


@pytest.mark.slow  # a child process imports tx_jax and tensorboardX from scratch
def test_writer_logs_scalars_without_importing_torch(tmp_path):
  # A fresh process: this one may have imported torch already (the parity tests do).
  out = subprocess.run(
      [sys.executable, "-c", _WRITE_AND_REPORT, str(tmp_path)],
      capture_output=True,
      text=True,
      check=True,
      timeout=120,
  )
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["torch_after_writer"] is False
  assert report["torch"]  # hiding torch did not break a later `import torch`

  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines == [
      {"step": 1, "loss": 2.5, "note": "text is not a scalar"},
      {"step": 2, "loss": 1.25},
  ]
  assert _scalars(tmp_path / "tensorboard") == {"loss": [(1, 2.5), (2, 1.25)]}
