"""Checkpoints on the disks clusters have: ranks that share none, disks that run full, saves that were killed.

- Ranks that share no disk (see [Note: ranks that share no disk] in lightning_fsdp/checkpoint/atomic.py): at world
  size 2 each rank saves into its own folder (different paths, as Ray Train gives them), at world size 4 two "nodes"
  of two ranks each save into their node's folder (one machine has one disk, so each node gets its own path). Every
  folder holds its ranks' shards with rank 0's ``.metadata`` and ``meta.pt``; alone it is refused as incomplete;
  copied into one folder (Ray's upload) it loads, and training resumed from it ends where the uninterrupted run does.
- A disk that runs full on one rank in the middle of a sharded write (a storage writer that gets the kernel's
  ``ENOSPC``, and, where a tmpfs can be mounted, a real small disk) is the same "no space left" sentence on every
  rank, naming the full folder; a full save that fails on rank 0 raises the same sentence on rank 1.
- Temporaries of killed writer processes are removed by the next save into the same folder, even where the pid they
  record is alive again; a live writer's temporary and a user's ``.partial-*`` are kept.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader

from lightning_fsdp import FSDPStrategy, fully_shard
from lightning_fsdp.checkpoint.atomic import atomic_directory, tensor_bytes
from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.checkpoint.sharded import (
    load_sharded,
    read_checked_metadata,
    save_sharded,
    sharded_checkpoint_state,
)
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, train_tokens
from tests.scripts.strategy_common import TINY
from tests.test_fabric import TinyLit, _as_launched_rank, _trainer

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"per_rank": (2, lambda rank: f"rank{rank}"), "two_nodes": (4, lambda rank: f"node{rank // 2}")}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _own_folder(out: Path, layout: str, rank: int) -> Path:
    return out / LAYOUTS[layout][1](rank) / "ckpt"


def _save_in_own_folders(rank: int, world_size: int, out_name: str, layout: str) -> None:
    """Train 2 steps, save into this rank's own folder (twice: the second replaces the first), train 2 more; an
    older checkpoint beside it goes through the strategy's ``remove_checkpoint`` (top-k rotation) on every disk."""
    out = Path(out_name)
    model, optimizer = _model()
    train_tokens(model, optimizer, 2, seed=rank)
    old = _own_folder(out, layout, rank).with_name("old")
    save_sharded(old, sharded_checkpoint_state(model, [optimizer]), {"global_step": 0})
    save_sharded(_own_folder(out, layout, rank), sharded_checkpoint_state(model, [optimizer]), {"global_step": 1})
    save_sharded(_own_folder(out, layout, rank), sharded_checkpoint_state(model, [optimizer]), {"global_step": 2})
    _as_launched_rank(rank, world_size)
    strategy = _trainer(FSDPStrategy(state_dict_type="sharded"), world_size).strategy
    assert strategy.is_global_zero == (rank == 0)
    strategy.remove_checkpoint(old)
    dist.barrier()
    assert not old.exists()
    train_tokens(model, optimizer, 2, seed=100 + rank)
    weights = full_state_dict(model)
    if rank == 0:
        torch.save(weights, out / "straight.pt")


def _resume_from_merged(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=50 + rank)  # different values, so the load must put every row in place
    meta = load_sharded(out / "merged", model, [optimizer])
    assert meta["global_step"] == 2
    train_tokens(model, optimizer, 2, seed=100 + rank)
    weights = full_state_dict(model)
    if rank == 0:
        torch.save(weights, out / "resumed.pt")


def _killed_writer(folder: Path, name: str) -> Path:
    """A process that starts a save into ``folder/name`` and is SIGKILLed mid-write; returns its temporary."""
    before = set(folder.glob(".partial-*")) if folder.is_dir() else set()
    writer = _start_writer(folder / name)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (left,) = set(folder.glob(".partial-*")) - before
    return left


def _start_writer(final: Path) -> subprocess.Popen:
    """A process inside a full save to ``final``, holding its write open until killed (it says when it is in)."""
    program = (
        "import sys; from pathlib import Path\n"
        "from lightning_fsdp.checkpoint.atomic import write_file_atomically\n"
        "def write(tmp):\n"
        "    tmp.write_bytes(b'half a checkpoint')\n"
        "    print('writing', flush=True)\n"
        "    sys.stdin.read()\n"
        f"write_file_atomically({str(final)!r}, write)\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, text=True
    )
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    return writer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_without_a_shared_disk_publish_their_own_parts_and_the_merge_resumes(tmp_path: Path, layout: str) -> None:
    world_size, folder_of = LAYOUTS[layout]
    last_folder = tmp_path / folder_of(world_size - 1)
    last_folder.mkdir()
    leftover = _killed_writer(last_folder, "ckpt")  # a killed save's temporary, in a non-zero rank's own folder
    run_distributed(_save_in_own_folders, world_size, str(tmp_path), layout, timeout=300)

    folders = sorted({_own_folder(tmp_path, layout, rank) for rank in range(world_size)})
    for folder in folders:
        ranks = [rank for rank in range(world_size) if _own_folder(tmp_path, layout, rank) == folder]
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [".metadata", "meta.pt", *(f"__{rank}_0.distcp" for rank in ranks)]
        ), folder
        assert torch.load(folder / "meta.pt", weights_only=True)["global_step"] == 2
        assert not list(folder.parent.glob(".partial-*")), folder.parent  # nothing left, the killed save's neither
        missing = next(rank for rank in range(world_size) if rank not in ranks)
        with pytest.raises(ValueError, match=rf"incomplete: shard file __{missing}_0.distcp is missing"):
            read_checked_metadata(folder)
    assert not leftover.exists()

    for folder in folders:  # what Ray's upload does: every worker's folder into one
        shutil.copytree(folder, tmp_path / "merged", dirs_exist_ok=True)
    run_distributed(_resume_from_merged, world_size, str(tmp_path), timeout=300)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-7, msg=name)


class _FullDiskWriter(FileSystemWriter):
    """DCP's file writer into the real folder, whose writes get what a full disk gives: the kernel's ``ENOSPC``."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


class _FullDiskCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _a_full_disk_on_one_rank(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    model, optimizer = _model()
    state = sharded_checkpoint_state(model, [optimizer])
    final = out / f"rank{rank}" / "ckpt"
    # Rank 1's disk runs full inside DCP's write: every rank names rank 1's folder, none keeps a temporary.
    with pytest.raises(OSError, match=r"^\[Errno 28\] no space left on device: needed ~[\d.]+ MB at .*rank1, "):
        with atomic_directory(final, expected_bytes=tensor_bytes(state)) as tmp:
            dcp.save(state, storage_writer=_FullDiskWriter(tmp) if rank == 1 else FileSystemWriter(tmp))
    assert not final.exists() and not list(final.parent.glob(".partial-*"))
    # A destination refused on one rank (its disk is too small for its share) is refused on every rank, up front.
    with pytest.raises(OSError, match=r"no space left on device: needed ~\d+ MB at .*rank1"):
        save_sharded(final, state if rank == 0 else {"w": torch.empty(2**40, device="meta")}, {})
    # A user's folder at rank 1's own destination: refused on every rank, before anything is written, and kept.
    users = out / "rank1" / "users"
    if rank == 1:
        users.mkdir()
        (users / "notes.txt").write_text("mine")
    dist.barrier()
    with pytest.raises(FileExistsError, match=r"^(rank 1: )?.*rank1/users is a folder holding files that are not part"):
        save_sharded(out / f"rank{rank}" / "users", state, {})
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"] and not (out / "rank0" / "users").exists()
    # A full save that fails on rank 0 (its disk full mid-write): the same sentence on both ranks.
    _as_launched_rank(rank, world_size)
    loader = DataLoader(torch.randint(0, TINY.vocab_size, (4, TINY.block_size + 1)), batch_size=2)
    trainer = _trainer(FSDPStrategy(state_dict_type="full"), world_size, max_steps=1, plugins=[_FullDiskCheckpointIO()])
    torch.manual_seed(0)
    trainer.fit(TinyLit(), loader)
    with pytest.raises(OSError, match=r"^\[Errno 28\] no space left on device: needed ~[\d.]+ MB at .*full_save"):
        trainer.save_checkpoint(out / "full_save" / "x.ckpt")
    dist.barrier()
    assert not list((out / "full_save").iterdir())


def test_a_full_disk_on_one_rank_is_the_same_sentence_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_a_full_disk_on_one_rank, 2, str(tmp_path), timeout=300)


def _rank1_on_a_small_disk(rank: int, world_size: int, out_name: str, disk_name: str) -> None:
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=rank)
    state = sharded_checkpoint_state(model, [optimizer])
    final = (Path(disk_name) if rank == 1 else Path(out_name)) / "ckpt"
    if rank == 1:  # leave a little more than this rank's share free: the check passes, the records do not fit
        free = shutil.disk_usage(disk_name).free
        (Path(disk_name) / "filler").write_bytes(bytes(free - tensor_bytes(state) - 16384))
        assert tensor_bytes(state) < shutil.disk_usage(disk_name).free < tensor_bytes(state) + 32768
    dist.barrier()
    with pytest.raises(OSError, match=r"^\[Errno 28\] no space left on device: needed ~[\d.]+ MB at .*small_disk,"):
        save_sharded(final, state, {"global_step": 1})
    assert not list(final.parent.glob(".partial-*")) and not final.exists()


def test_a_real_disk_running_full_under_one_rank_is_named_on_every_rank(tmp_path: Path, small_disk: Path) -> None:
    run_distributed(_rank1_on_a_small_disk, 2, str(tmp_path), str(small_disk), timeout=300)


def test_only_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    killed = _killed_writer(tmp_path, "a.ckpt")
    # A reused pid (after a container restart the new process often has the pid the killed one had): the writer
    # record names a live process, ours; the lock the kernel dropped with the killed writer still tells.
    record_file = next(killed.glob(".lightning_fsdp-writer-*"))
    record = json.loads(record_file.read_text())
    reused = _killed_writer(tmp_path, "b.ckpt")
    reused_record = next(reused.glob(".lightning_fsdp-writer-*"))
    started = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    reused_record.write_text(json.dumps({**record, "pid": os.getpid(), "started": started}))
    live = _start_writer(tmp_path / "c.ckpt")
    (live_temporary,) = set(tmp_path.glob(".partial-*")) - {killed, reused}
    users = [tmp_path / ".partial-foo", tmp_path / f".partial-{'0' * 32}.tmp"]  # the second has our shape, no record
    for folder in users:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    try:
        save_full_checkpoint(tmp_path / "d.ckpt", {"state_dict": {}})
        assert not killed.exists() and not reused.exists()
        assert live_temporary.is_dir() and all((folder / "notes.txt").is_file() for folder in users)
    finally:
        live.kill()
        live.wait()
    save_full_checkpoint(tmp_path / "d.ckpt", {"state_dict": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d.ckpt", *(folder.name for folder in users)])
