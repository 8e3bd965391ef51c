"""tx_jax.train: optimizers, schedules, losses, pure train/eval steps, and the training loop."""

from tx_jax.train.loop import NonFiniteLossError, train_and_evaluate
from tx_jax.train.optimizers import build_optimizer
from tx_jax.train.schedules import build_schedule
from tx_jax.train.state import TrainState
from tx_jax.train.steps import eval_step, train_step

__all__ = [
    "NonFiniteLossError",
    "TrainState",
    "build_optimizer",
    "build_schedule",
    "eval_step",
    "train_and_evaluate",
    "train_step",
]
