"""Learning-rate schedules against their formulas."""

import math

import ml_collections
import numpy as np
import pytest

from configs import train_defaults
from tx_jax.train import schedules


def _cfg(**kw) -> ml_collections.ConfigDict:
  c = train_defaults.schedule_config()
  c.update(kw)
  return c


@pytest.mark.parametrize("step", [1, 10, 100, 3999, 4000, 4001, 10_000, 100_000])
def test_paper_schedule_equals_formula(step):
  sched = schedules.build_schedule(_cfg(name="paper", warmup_steps=4000), 1.0, 10, d_model=512)
  expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
  # optax calls the schedule with the count of applied updates: step s uses count s - 1.
  np.testing.assert_allclose(float(sched(step - 1)), expected, rtol=1e-6)


def test_inverse_sqrt_is_flat_in_warmup_then_decays():
  sched = schedules.build_schedule(_cfg(name="inverse_sqrt", warmup_steps=100), 1.0, 10)
  np.testing.assert_allclose(
      [float(sched(s - 1)) for s in (1, 50, 100, 400)], [0.1, 0.1, 0.1, 0.05], rtol=1e-6
  )


def test_warmup_cosine_and_linear_shapes():
  cos = schedules.build_schedule(
      _cfg(name="warmup_cosine", warmup_steps=10, end_factor=0.1), 2.0, 110
  )
  lin = schedules.build_schedule(_cfg(name="warmup_linear", warmup_steps=10), 2.0, 110)
  for s in (0, 5, 10, 60, 110):
    warm = 2.0 * s / 10
    frac = (s - 10) / 100
    exp_cos = warm if s < 10 else 0.2 + (2.0 - 0.2) * 0.5 * (1 + math.cos(math.pi * frac))
    exp_lin = warm if s < 10 else 2.0 * (1 - frac)
    np.testing.assert_allclose(float(cos(s)), exp_cos, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(lin(s)), exp_lin, rtol=1e-5, atol=1e-7)
  const = schedules.build_schedule(_cfg(name="constant", warmup_steps=0), 3e-4, 10)
  assert float(const(12345)) == pytest.approx(3e-4)


def test_bad_schedule_names_the_field():
  with pytest.raises(ValueError, match="config.schedule.name='cosin'"):
    schedules.build_schedule(_cfg(name="cosin"), 1.0, 10)
  with pytest.raises(ValueError, match="decay_steps"):
    schedules.build_schedule(_cfg(name="warmup_cosine", warmup_steps=20), 1.0, 10)
