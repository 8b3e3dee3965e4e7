"""``CharDataModule``: the byte-level demo corpus as Lightning train/val/test/predict data.

The token stream of :func:`lightning_fsdp.demos.corpus.load_corpus` (the standard library's own sources, or a
text file of the user's) is cut into three contiguous parts, train first, then validation, then test. Contiguous
parts, rather than windows drawn at random from the whole stream, keep the evaluation text out of training: two
overlapping windows would otherwise share most of their bytes. Each part is read as non-overlapping windows of
``block_size + 1`` bytes, so every epoch sees every byte once.

The loaders are plain ``DataLoader``s with ``shuffle`` set and no sampler of their own, which is what Lightning
needs to swap in a ``DistributedSampler``: under a multi-process strategy every rank then reads a different
slice of the windows, reshuffled every epoch from the Trainer's seed.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_fsdp.demos.corpus import load_corpus

__all__ = ["CharDataModule", "TokenWindows"]


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of a token stream: item ``i`` is ``(inputs, targets)``, targets shifted by one.

    A window needs ``block_size + 1`` tokens (its last target is the token after its last input); consecutive
    windows share that one token, so the whole stream is covered and no byte is a target twice.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class CharDataModule(LightningDataModule):
    """The demo corpus as fixed-length byte windows, split into train, validation and test parts.

    Args:
        path: a text file to train on, read as bytes; None for the Python standard library's sources.
        max_bytes: how much of the corpus to read.
        block_size: tokens per window; at most the model's ``block_size``.
        batch_size: windows per batch on each rank.
        val_fraction: the share of the corpus, after the training part, used for validation.
        test_fraction: the share at the end of the corpus used for testing and as prompts for prediction.
        num_workers: ``DataLoader`` worker processes; 0 (the default) reads in the training process, which is
            the right choice for this in-memory data and keeps 2-CPU runs from oversubscribing the cores.
    """

    def __init__(
        self,
        path: str | None = None,
        max_bytes: int = 2_000_000,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must each lie in (0, 1) and "
                "leave some of the corpus for training; 0.05 each is a sensible start."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.save_hyperparameters()
        self.splits: dict[str, TokenWindows] = {}

    @override
    def setup(self, stage: str) -> None:
        """Read the corpus and cut it; every rank does this itself (there is nothing to download or share)."""
        if self.splits:
            return
        tokens = load_corpus(self.hparams.path, max_bytes=self.hparams.max_bytes)
        n = tokens.numel()
        val_start = int(n * (1 - self.hparams.val_fraction - self.hparams.test_fraction))
        test_start = int(n * (1 - self.hparams.test_fraction))
        parts = {"train": tokens[:val_start], "val": tokens[val_start:test_start], "test": tokens[test_start:]}
        self.splits = {name: TokenWindows(part, self.hparams.block_size) for name, part in parts.items()}
        short = [name for name, windows in self.splits.items() if len(windows) == 0]
        if short:
            source = self.hparams.path or "the standard library sources"
            raise ValueError(
                f"the corpus ({n} bytes of {source}) leaves the {', '.join(short)} part(s) shorter than one window "
                f"of block_size + 1 = {self.hparams.block_size + 1} bytes; raise max_bytes or the fractions, or "
                "lower block_size."
            )

    @override
    def train_dataloader(self) -> DataLoader:
        # drop_last: every step sees a full batch, so the loss of every step weighs the same number of tokens.
        return self._loader("train", shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False, drop_last=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False, drop_last=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        """The test windows, whose inputs ``LitGPT.predict_step`` continues; bound them with
        ``Trainer(limit_predict_batches=...)``."""
        return self._loader("test", shuffle=False, drop_last=False)

    def _loader(self, split: str, shuffle: bool, drop_last: bool) -> DataLoader:
        if split not in self.splits:
            raise RuntimeError(f"CharDataModule.setup() must run before the {split} loader is built")
        workers = self.hparams.num_workers
        return DataLoader(
            self.splits[split],
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
