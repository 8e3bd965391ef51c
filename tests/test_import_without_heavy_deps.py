"""tx_jax.models and tx_jax.layers import, build and run a model with TensorFlow, TFDS, torch
and transformers unimportable: those serve data preparation, parity tests and benchmarks only,
so a GPU or TPU environment without them can still train and apply models."""

import subprocess
import sys
import textwrap

BLOCKED = ("tensorflow", "tensorflow_datasets", "torch", "transformers")

# A fresh interpreter: this process may already hold the blocked modules from other tests.
SCRIPT = textwrap.dedent(
    f"""
    import sys
    for name in {BLOCKED!r}:
      sys.modules[name] = None  # `import name` now raises ImportError

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import tx_jax.layers
    from configs import gpt
    from tx_jax import models

    model = models.build(gpt.get_config("tiny").model)
    ids = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 200
    params = nn.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])

    def loss(params):
      logits = model.apply({{"params": params}}, ids)
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
          logits, ids[..., None], axis=-1)[..., 0])

    value, grads = jax.value_and_grad(loss)(params)
    assert jnp.isfinite(value), value
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    loaded = sorted(m for m in {BLOCKED!r} if sys.modules.get(m) is not None)
    assert not loaded, loaded
    print("ok", float(value))
    """
)


def test_models_and_layers_run_without_tensorflow_or_torch():
  result = subprocess.run(
      [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("ok"), result.stdout
