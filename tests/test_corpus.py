"""The demo corpus: deterministic, byte-level, and batches whose targets are the inputs shifted by one."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from lightning_fsdp.demos.corpus import load_corpus, random_batches


def test_stdlib_corpus_is_the_first_bytes_of_the_sorted_sources() -> None:
    tokens = load_corpus(max_bytes=5_000)
    assert tokens.dtype == torch.long and tokens.shape == (5_000,)
    assert 0 <= tokens.min() and tokens.max() < 256
    first = (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_bytes()
    assert bytes(tokens[:100].tolist()) == first[:100]
    assert torch.equal(load_corpus(max_bytes=5_000), tokens)


def test_stdlib_corpus_spans_files_up_to_max_bytes() -> None:
    # Larger than any single stdlib file: the corpus must continue into the next files, not stop at one.
    assert load_corpus(max_bytes=400_000).numel() == 400_000


def test_a_text_file_is_read_as_bytes_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_text("héllo wörld", encoding="utf-8")
    assert bytes(load_corpus(path).tolist()) == "héllo wörld".encode()
    assert bytes(load_corpus(path, max_bytes=3).tolist()) == b"h\xc3\xa9"


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(path)


def test_batches_are_windows_with_targets_shifted_by_one() -> None:
    tokens = torch.arange(1_000)
    inputs, targets = random_batches(tokens, batch_size=8, block_size=16, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (8, 16)
    assert torch.equal(targets, inputs + 1)  # with tokens == positions, a window is a run of consecutive values
    assert torch.equal(inputs[:, 1:], inputs[:, :-1] + 1)


def test_batches_are_determined_by_the_generator_seed() -> None:
    tokens = load_corpus(max_bytes=10_000)

    def batch(seed: int) -> torch.Tensor:
        return random_batches(tokens, 4, 32, torch.Generator().manual_seed(seed))[0]

    assert torch.equal(batch(1), batch(1))
    assert not torch.equal(batch(1), batch(2))


def test_a_corpus_shorter_than_a_window_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than block_size"):
        random_batches(torch.arange(16), 2, 16, torch.Generator())
