"""The state's initialisation compiled with run.CPU_INIT_OPTIONS has XLA's default bits.

On CPU the trainer compiles `init` at LLVM's -O1, unless XLA_FLAGS name a level, because
it runs once and its compile is the slow part; the parameters and optimizer state must be
exactly what the default compile gives, for every family (T5's relative bias, BERT's heads,
LLaMA's untied output, the encoder-decoder's two stacks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import bert, gpt, t5, transformer
from tests import conftest
from tx_jax import models, sharding
from tx_jax.train import optimizers, run

pytestmark = pytest.mark.slow  # five models, each compiled twice (~40 s on 2 cores)

# XLA:CPU's own defaults, which the trainer's other programs compile with.
XLA_DEFAULTS = conftest.XLA_DEFAULT_LEVEL


CONFIGS = {
    "transformer:tiny": lambda: transformer.get_config("tiny"),
    "t5:tiny": lambda: t5.get_config("tiny"),
    "bert:tiny-sst2": lambda: bert.get_config("tiny-sst2"),
    "gpt:tiny-shakespeare": lambda: gpt.get_config("tiny-shakespeare"),
    "gpt:llama-tiny": lambda: gpt.get_config("llama-tiny"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_at_the_cheaper_level_has_the_default_bits(name):
  config = CONFIGS[name]()
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  module = models.build(config.model)
  tx, _ = optimizers.build_optimizer(config)
  ids = jnp.zeros((1, 8), jnp.int32)
  family = config.model.family
  names = ("encoder_inputs", "decoder_inputs") if family == "encdec" else ("inputs",)
  example = dict.fromkeys(names, ids)
  layout = run.state_layout(config, module, tx, example, mesh, sharding.logical_rules(config))
  assert run.CPU_INIT_OPTIONS != {}

  def leaves(options):
    # conftest's XLA_FLAGS compile the tests at level 0: both programs name their level.
    options = {**XLA_DEFAULTS, **options}
    state = jax.jit(layout.init_fn, compiler_options=options)()
    return [np.asarray(x) for x in jax.tree.leaves(state)]

  cheaper, default = leaves(run.CPU_INIT_OPTIONS), leaves({})
  assert len(cheaper) == len(default) > 4
  for ours, theirs in zip(cheaper, default, strict=True):
    np.testing.assert_array_equal(ours, theirs)


def test_init_takes_the_cheaper_level_unless_xla_flags_name_one(monkeypatch):
  """The trainer's per-program level yields to a level the user put in XLA_FLAGS (as this
  test session does: conftest compiles every program at level 0)."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert run.init_compiler_options("cpu") == run.CPU_INIT_OPTIONS
  assert run.init_compiler_options("gpu") == {}
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
  assert run.init_compiler_options("cpu") == {}
