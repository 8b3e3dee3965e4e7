"""CharDataModule: contiguous, disjoint splits of the corpus, read as non-overlapping shifted windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_fsdp.demos.corpus import load_corpus
from lightning_fsdp.demos.datamodule import CharDataModule, TokenWindows


def test_windows_cover_the_stream_with_targets_shifted_by_one() -> None:
    tokens = torch.arange(23)
    windows = TokenWindows(tokens, block_size=5)
    assert len(windows) == 4  # (23 - 1) // 5: a window needs block_size + 1 tokens
    inputs, targets = windows[1]
    assert inputs.tolist() == [5, 6, 7, 8, 9] and targets.tolist() == [6, 7, 8, 9, 10]
    # Consecutive windows meet exactly: every token but the first is a target once.
    all_targets = torch.cat([windows[i][1] for i in range(len(windows))])
    assert all_targets.tolist() == list(range(1, 21))
    with pytest.raises(IndexError):
        windows[4]


def test_splits_are_contiguous_disjoint_and_sized_by_the_fractions() -> None:
    data = CharDataModule(max_bytes=10_000, block_size=16, val_fraction=0.1, test_fraction=0.2)
    data.setup("fit")
    parts = [data.splits[name].tokens for name in ("train", "val", "test")]
    assert torch.equal(torch.cat(parts), load_corpus(max_bytes=10_000))
    assert [part.numel() for part in parts] == [7_000, 1_000, 2_000]


def test_loaders_shuffle_only_training_and_leave_the_sampler_to_lightning() -> None:
    data = CharDataModule(max_bytes=10_000, block_size=16, batch_size=4)
    data.setup("fit")
    train, val = data.train_dataloader(), data.val_dataloader()
    # A plain RandomSampler / SequentialSampler is what Lightning replaces by a DistributedSampler (shuffled
    # or not to match) under a multi-process strategy; a custom sampler would be kept and duplicate data.
    assert type(train.sampler) is RandomSampler and train.drop_last
    assert type(val.sampler) is SequentialSampler and not val.drop_last
    inputs, targets = next(iter(train))
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.long


def test_a_users_text_file_replaces_the_corpus(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 4)
    data = CharDataModule(path=str(path), block_size=8, val_fraction=0.25, test_fraction=0.25)
    data.setup("test")
    assert data.splits["train"].tokens.tolist() == list(range(256)) * 2


def test_a_corpus_too_short_for_one_window_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"val, test part\(s\) shorter than one window .* raise max_bytes"):
        CharDataModule(path=str(path), block_size=32).setup("fit")


@pytest.mark.parametrize(("val", "test"), [(0.0, 0.1), (0.5, 0.5), (0.1, 1.2)])
def test_fractions_that_leave_no_split_are_refused(val: float, test: float) -> None:
    with pytest.raises(ValueError, match="must each lie in"):
        CharDataModule(val_fraction=val, test_fraction=test)
