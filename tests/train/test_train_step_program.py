"""The trainer's compiled train step: Adam's moments updated in place, the same bits.

run.jit_steps compiles the step with XLA:CPU's region-analysis copy insertion
(run.CPU_TRAIN_STEP_OPTIONS). Without it every donated moment leaf is copied at the start
of each step; with it none is, and the program computes exactly what the default does.
"""

import re

import jax
import numpy as np
import pytest

from configs import gpt
from tests import conftest
from tests.train import batches
from tx_jax import models, sharding
from tx_jax.train import optimizers, run

pytestmark = pytest.mark.slow  # the step compiled twice and run six times (~12 s)


def _copied_parameters(hlo_text: str) -> int:
  """How many entry parameters the compiled program copies (`copy(%p)`, p a parameter)."""
  entry = hlo_text[hlo_text.index("\nENTRY") :]
  parameters = set(re.findall(r"%(\S+) = \S+ parameter\(", entry))
  return sum(name in parameters for name in re.findall(r" copy\(%([^)\s]+)\)", entry))


def test_the_train_step_updates_adams_moments_in_place_with_the_same_bits():
  config = gpt.get_config("tiny")
  config.mesh.cpu_devices = 1
  batch = batches.lm_batch(np.random.default_rng(0))
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  rules = sharding.logical_rules(config)
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  layout = run.state_layout(config, module, tx, batch, mesh, rules)
  init = jax.jit(layout.init_fn, out_shardings=layout.shardings)
  step, _ = run.jit_steps(config, module, tx, schedule, layout.shardings, mesh, rules)
  lowered = step.lower(init(), batch)
  # Both at XLA's own defaults, as the trainer compiles (conftest's fast-compile flags
  # choose other fusions, which this option can reorder).
  shipped = lowered.compile(
      compiler_options={**conftest.XLA_DEFAULT_LEVEL, **run.CPU_TRAIN_STEP_OPTIONS}
  )
  default = lowered.compile(
      compiler_options={
          **conftest.XLA_DEFAULT_LEVEL,
          **{option: False for option in run.CPU_TRAIN_STEP_OPTIONS},
      }
  )

  moments = 2 * len(jax.tree.leaves(layout.abstract_state.params))
  assert _copied_parameters(default.as_text()) >= moments  # what the option removes
  assert _copied_parameters(shipped.as_text()) == 0

  def three_steps(compiled):
    state, packed_metrics = init(), []
    for _ in range(3):
      state, metrics = compiled(state, batch)
      packed_metrics.append(np.asarray(metrics))
    return [np.asarray(x) for x in jax.tree.leaves(state)] + packed_metrics

  for ours, theirs in zip(three_steps(shipped), three_steps(default), strict=True):
    np.testing.assert_array_equal(ours, theirs)
