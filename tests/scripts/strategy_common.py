"""What the strategy's Trainer scripts share: a tiny GPT LightningModule, random token data, a quiet Trainer.

The scripts run as ``python tests/scripts/<name>.py OUT_DIR``; Lightning's launcher starts rank 1 by running the
same command line again, so every script is a straight sequence of Trainer runs that both ranks walk through, and
only rank 0 writes results into OUT_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_fsdp.demos.gpt import GPT, GPTConfig

# Dims that divide by neither 2 nor 4 (61 rows, 18-wide rows), as in the engine's parity tests.
TINY = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18, bias=True)


class LitGPT(L.LightningModule):
    """The demo GPT as a LightningModule; the optimizer is the engine parity tests' AdamW (lr 1e-3, eps 1e-5)."""

    def __init__(self, config: GPTConfig = TINY, lr: float = 1e-3, in_configure_model: bool = False) -> None:
        super().__init__()
        self.config = config
        self.lr = lr
        self.model = None if in_configure_model else GPT(config)

    def configure_model(self) -> None:
        """Builds the GPT if ``__init__`` did not: under ``myfsdp`` this runs on the meta device (deferred init)."""
        if self.model is None:
            self.model = GPT(self.config)
            self.built_on_meta = next(self.model.parameters()).is_meta

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch[:, :-1], batch[:, 1:])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(batch[:, :-1], batch[:, 1:]), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.model(batch[:, :-1], batch[:, 1:]), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch[:, :-1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-5, weight_decay=0.1)


def token_loader(num_samples: int, batch_size: int, config: GPTConfig = TINY, seed: int = 1) -> DataLoader:
    """Random token sequences of ``block_size + 1`` (inputs and shifted targets), the same on every rank; the
    Trainer's distributed sampler gives each rank its own half."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (num_samples, config.block_size + 1), generator=generator)
    return DataLoader(tokens, batch_size=batch_size)


def make_trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    """A 2-process CPU Trainer with everything that costs time and is not under test turned off."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(strategy=strategy, **{**options, **kwargs})


def out_dir() -> Path:
    return Path(sys.argv[1])


def write_json(trainer: L.Trainer, name: str, value: Any, every_rank: bool = False) -> None:
    """Rank 0 writes ``value`` to OUT_DIR/name; with ``every_rank``, each rank writes OUT_DIR/name.rank<r>."""
    if every_rank:
        (out_dir() / f"{name}.rank{trainer.global_rank}").write_text(json.dumps(value))
    elif trainer.global_rank == 0:
        (out_dir() / name).write_text(json.dumps(value))
