"""config.mesh.cpu_devices: the process's CPU split into JAX devices, data parallel over them.

In-process tests run under conftest's 8 fake CPU devices, of which a run uses the first
`cpu_devices`; the trainer runs in fresh processes (one real device otherwise), where the
field splits the process, for the rest.
"""

import jax
import ml_collections
import pytest

from configs import gpt
from tests.train import runs
from tx_jax import sharding


def _mesh(cpu_devices):
  config = gpt.get_config("tiny")
  config.mesh.cpu_devices = cpu_devices
  return config


@pytest.mark.parametrize("bad", [-1, True, "2", 1.5])
def test_bad_counts_are_named_with_what_is_accepted(bad):
  with pytest.raises(ValueError, match=r"config\.mesh\.cpu_devices=.*expected an int >= 0"):
    sharding.use_cpu_devices(ml_collections.ConfigDict({"cpu_devices": bad}))


def test_validation_checks_the_field_before_anything_runs():
  with pytest.raises(ValueError, match=r"config\.mesh\.cpu_devices=-1"):
    sharding.validate(_mesh(-1), num_devices=8)


def test_a_running_backend_lends_its_first_devices_and_too_few_is_an_error():
  assert jax.local_device_count() == 8  # conftest started the backend
  sharding.use_cpu_devices(_mesh(0).mesh)  # JAX's default: nothing to do
  assert sharding.run_devices(_mesh(0).mesh) == jax.devices()
  sharding.use_cpu_devices(_mesh(2).mesh)  # fewer than there are: the first 2
  assert sharding.run_devices(_mesh(2).mesh) == jax.devices()[:2]
  mesh = sharding.make_mesh(_mesh(2).mesh)
  assert mesh.devices.size == 2 and dict(mesh.shape)["data"] == 2
  sharding.validate(_mesh(2), num_devices=len(sharding.run_devices(_mesh(2).mesh)))
  too_many = r"cpu_devices=9, .*already runs with 8 devices.*cpu_devices=0"
  with pytest.raises(ValueError, match=too_many):
    sharding.use_cpu_devices(_mesh(9).mesh)


def test_tiny_shakespeare_ships_two_cpu_devices_and_they_divide_its_batches():
  config = gpt.get_config("tiny-shakespeare")
  assert config.mesh.cpu_devices == gpt.CPU_DEVICES == 2
  sharding.validate(config, num_devices=gpt.CPU_DEVICES)


@pytest.mark.slow
def test_two_cpu_devices_train_as_one_and_the_mesh_says_so(tmp_path):
  """The same first 4 steps on 1 and on 2 CPU devices give the same losses (the batch mean
  is summed in another order); the 2-device run goes on to 120 steps of ~5 ms, far more
  than the ~33 steps XLA:CPU can hold in flight across devices (sharding.use_cpu_devices),
  so it also shows the trainer never queues that many. The dry run shows the mesh."""
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  losses = {}
  for count, steps in ((1, 4), (2, 120)):
    schedule = {"schedule.warmup_steps": 2, "schedule.decay_steps": 200}  # the same LRs
    flags = runs.tiny_gpt_flags(
        corpus, tmp_path / f"run{count}", steps=steps, **{"mesh.cpu_devices": count}, **schedule
    )
    result = runs.run(flags, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    losses[count] = runs.losses(tmp_path / f"run{count}")
    dry = runs.run(flags + ["--dry_run"])
    assert f"mesh: data={count}, fsdp=1, sequence=1, tensor=1 ({count} devices)" in dry.stdout
  assert sorted(losses[1]) == [1, 2, 3, 4] and sorted(losses[2]) == list(range(1, 121))
  for step, loss in losses[1].items():
    assert losses[2][step] == pytest.approx(loss, rel=1e-5), step
