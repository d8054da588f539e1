"""Training: the SFT loop, its config, checkpoints, schedule and metrics."""

from .config import TrainConfig
from .trainer import Trainer, TrainResult

__all__ = ["TrainConfig", "Trainer", "TrainResult"]
