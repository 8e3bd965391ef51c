"""MetricsWindow: packed metrics pulled in arrears, summed per log window, nothing lost."""

import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.train import metrics as metrics_lib
from tx_jax.train import steps


def _packed(loss_sum, weight_sum, nonfinite=0, lr=1e-3):
  values = dict(
      loss_sum=loss_sum,
      nll_sum=loss_sum,
      correct_sum=weight_sum / 2,
      weight_sum=weight_sum,
      grad_norm=1.0,
      nonfinite=nonfinite,
      learning_rate=lr,
  )
  return steps.pack_metrics({k: jnp.asarray(v) for k, v in values.items()})


def _window(log_every, total, lines, bad):
  return metrics_lib.MetricsWindow(
      log_every=log_every,
      total=total,
      flops_per_token=1.0,
      peak_flops=1.0,
      report=lambda step, m: lines.append((step, dict(m))),
      on_nonfinite=bad.append,
  )


@pytest.mark.parametrize("pull_seconds", [0.0, 1e9])  # every step / only at log steps
def test_every_step_is_summed_into_its_window_whenever_it_is_pulled(monkeypatch, pull_seconds):
  monkeypatch.setattr(metrics_lib.MetricsWindow, "PULL_SECONDS", pull_seconds)
  lines, bad = [], []
  window = _window(log_every=4, total=10, lines=lines, bad=bad)
  for step in range(1, 11):
    # Step s has loss s over weight 2, and step 6 is non-finite.
    window.push(step, _packed(float(step), 2.0, nonfinite=int(step == 6), lr=step * 1e-4), 2)
  window.flush()
  assert [s for s, _ in lines] == [4, 8, 10]
  # Window losses: (1+2+3+4)/8, (5+6+7+8)/8, (9+10)/4.
  np.testing.assert_allclose([m["loss"] for _, m in lines], [10 / 8, 26 / 8, 19 / 4])
  assert all(m["accuracy"] == pytest.approx(0.5) for _, m in lines)
  np.testing.assert_allclose([m["learning_rate"] for _, m in lines], [4e-4, 8e-4, 1e-3], rtol=1e-6)
  assert bad == [6]


def test_the_host_never_runs_more_than_max_pending_steps_ahead(monkeypatch):
  monkeypatch.setattr(metrics_lib.MetricsWindow, "PULL_SECONDS", 1e9)
  lines, bad = [], []
  window = _window(log_every=1000, total=1000, lines=lines, bad=bad)
  for step in range(1, 60):
    window.push(step, _packed(1.0, 1.0), 1)
    assert len(window._pending) <= metrics_lib.MetricsWindow.MAX_PENDING  # pylint: disable=protected-access


def test_pack_metrics_rejects_a_different_set_of_names():
  with pytest.raises(ValueError, match="METRIC_NAMES"):
    steps.pack_metrics({"loss_sum": jnp.zeros(())})
