"""Progress display: a tqdm bar (ETA, tokens/s, loss) on a terminal, plain log lines otherwise."""

import sys
import time

import tqdm

MODES = ("auto", "bar", "log")


class Progress:
  """Shows training progress from `start` to `total` steps."""

  def __init__(self, mode: str, start: int, total: int, enabled: bool = True):
    if mode not in MODES:
      raise ValueError(f"config.train.progress={mode!r}: expected one of {MODES}")
    self.bar = None
    self.enabled = enabled
    self.total = total
    if enabled and (mode == "bar" or (mode == "auto" and sys.stderr.isatty())):
      self.bar = tqdm.tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
    self.last = start
    self.start_time = time.time()

  def update(self, step: int, values: dict) -> None:
    """Moves to `step`; `values` (loss, tokens_per_sec, eval_*) go in the bar or a line."""
    if not self.enabled:
      return
    shown = {
        k: v for k, v in values.items() if k in ("loss", "tokens_per_sec") or k.startswith("eval_")
    }
    if self.bar is not None:
      self.bar.update(step - self.last)
      self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
    else:
      text = "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
      print(f"step {step}/{self.total}  {text}  ({time.time() - self.start_time:.0f}s)", flush=True)
    self.last = step

  def write(self, text: str) -> None:
    """A message that does not break the bar."""
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
