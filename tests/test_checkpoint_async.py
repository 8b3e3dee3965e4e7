"""Checkpoints written in the background (``FSDPStrategy(async_save=True)``, ``AsyncCheckpointIO``), on real ranks.

- Under a Trainer with ``ModelCheckpoint`` every 2 steps (keeping the newest only, so every save removes the one
  before): the checkpoints an asynchronous run leaves (``async_save=True``, ``AsyncCheckpointIO``; sharded, and a
  full file) are those of a synchronous run, and resuming from either ends in the same weights. A training step
  completes while the first sharded write is held inside DCP's writer (it waits on an event the training side sets
  after that step): the write overlaps training, and its checkpoint is not under its name before it is complete.
- A write that fails in the background (one rank's storage writer raises) is raised at the next save, the same
  sentence on every rank, and a removal asked for meanwhile is dropped, so the older checkpoint stays; a failure of
  the last write is raised by teardown. The same for a full file rank 0 writes in the background (its disk full). A
  save made for SLURM's requeue is complete when the call returns.
- Under Fabric (``FabricFSDPStrategy(async_save=True)``): a step runs while the write is held, the next save waits
  for it, teardown for the last, and both checkpoints load back as they were at their saves.
- A rank killed (SIGKILL) during its background write leaves the previous checkpoint under the name intact and
  loadable; the next save into the folder removes the killed write's temporary.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint import FileSystemWriter

import lightning_fsdp.checkpoint.sharded as sharded_module
from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy
from lightning_fsdp.checkpoint.async_save import BackgroundSaver
from lightning_fsdp.checkpoint.sharded import load_sharded, read_checked_metadata, sharded_checkpoint_state
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import train_tokens
from tests.scripts.strategy_common import LitGPT, token_loader
from tests.test_checkpoint_disks import _FullDiskCheckpointIO, _model
from tests.test_cli_configs import CONFIGS, print_config
from tests.test_fabric import TinyLit, _as_launched_rank, _trainer, adamw, gpt_batches, launch, train, weights


class _HeldWriter(FileSystemWriter):
    """DCP's file writer, told by the test what each of this process's next writes does inside ``write_data`` (one
    set of actions per write, in order; none left: write normally): ``"hold"`` says so through ``entered`` and waits
    for ``release``, ``"fail"`` raises on rank 1, ``"kill"`` kills rank 1 once its data is on disk."""

    actions: list[set[str]] = []
    entered = threading.Event()
    release = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        action = _HeldWriter.actions.pop(0) if _HeldWriter.actions else set()
        if "hold" in action:
            _HeldWriter.entered.set()
            assert _HeldWriter.release.wait(timeout=120), "the training side never released the write"
        if "fail" in action and dist.get_rank() == 1:
            raise RuntimeError("the store went away")
        written = super().write_data(plan, planner)
        if "kill" in action and dist.get_rank() == 1:
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written


class _ReleaseAfterAStep(Callback):
    """At the end of step 3 (the first save, at step 2, is held in its writer): record what the training side sees,
    then let the write go on."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self.seen: dict[str, bool] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != 3:
            return
        self.seen = {
            "writer_entered": _HeldWriter.entered.wait(timeout=120),  # the write is under way, held in its writer
            "write_in_flight": not _HeldWriter.release.is_set(),
            "step_2_not_yet_published": not (self.dirpath / "step=2.ckpt").exists(),
        }
        _HeldWriter.release.set()


def _fit(rank: int, out: Path, name: str, hold: bool = False, **strategy_options: Any) -> dict[str, torch.Tensor]:
    """6 steps, a sharded checkpoint every 2 (the newest kept), in ``out/name``; the final full weights. ``hold``:
    the first write is held until a step after it has completed."""
    dirpath = out / name
    release = _ReleaseAfterAStep(dirpath)
    checkpoints = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=1)
    plugins = strategy_options.pop("plugins", [])
    trainer = _trainer(
        FSDPStrategy(**{"state_dict_type": "sharded", **strategy_options}),
        2,
        max_steps=6,
        callbacks=[release, checkpoints] if hold else [checkpoints],
        enable_checkpointing=True,
        plugins=plugins,
    )
    torch.manual_seed(0)
    model = LitGPT()
    trainer.fit(model, token_loader(24, 2))
    assert not hold or release.seen == dict.fromkeys(release.seen, True) and release.seen, (rank, release.seen)
    dist.barrier()  # every rank's teardown has run the removals of its last write
    assert sorted(p.name for p in dirpath.iterdir()) == ["step=6.ckpt"], (rank, list(dirpath.iterdir()))
    return full_state_dict(model)


def _resume(out: Path, name: str) -> dict[str, torch.Tensor]:
    trainer = _trainer(FSDPStrategy(state_dict_type="full" if name.startswith("full") else "sharded"), 2, max_steps=8)
    torch.manual_seed(1)
    model = LitGPT()
    trainer.fit(model, token_loader(24, 2), ckpt_path=out / name / "step=6.ckpt")
    return full_state_dict(model)


def _async_equals_sync(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    _as_launched_rank(rank, world_size)
    sharded_module.FileSystemWriter = _HeldWriter
    sync = _fit(rank, out, "sync")
    _HeldWriter.actions = [{"hold"}]
    in_background = _fit(rank, out, "async", hold=True, async_save=True)
    plugin = _fit(rank, out, "plugin", plugins=[AsyncCheckpointIO()])
    full = _fit(rank, out, "full_async", state_dict_type="full", async_save=True)
    resumed = {name: _resume(out, name) for name in ("sync", "async", "plugin", "full_async")}
    if rank == 0:
        for name, weights in {"async": in_background, "plugin": plugin, "full_async": full}.items():
            for key, value in sync.items():
                torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=f"{name}: {key}")
                torch.testing.assert_close(resumed[name][key], resumed["sync"][key], rtol=0, atol=0, msg=key)


def test_async_sharded_saves_overlap_training_and_resume_as_sync_ones(tmp_path: Path) -> None:
    run_distributed(_async_equals_sync, 2, str(tmp_path), timeout=600)


def _failures_surface(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    _as_launched_rank(rank, world_size)
    sharded_module.FileSystemWriter = _HeldWriter
    trainer = _trainer(FSDPStrategy(state_dict_type="sharded", async_save=True), 2, max_steps=1)
    torch.manual_seed(0)
    trainer.fit(LitGPT(), token_loader(4, 2))
    strategy = trainer.strategy
    _HeldWriter.actions = [set(), {"hold", "fail"}, {"fail"}]
    trainer.save_checkpoint(out / "older")
    trainer.save_checkpoint(out / "failing")  # returns at once: the write is held, then fails on rank 1
    strategy.remove_checkpoint(out / "older")  # asked for while the write is in flight: waits for it
    assert (out / "older").is_dir()
    _HeldWriter.release.set()
    with pytest.raises(RuntimeError, match=r"^the background save to .*failing failed on rank \d .*the store went"):
        trainer.save_checkpoint(out / "next")
    sentences = [None] * world_size
    try:
        trainer.save_checkpoint(out / "last")  # fails in the background too, raised by teardown
        strategy.teardown()
    except RuntimeError as err:
        sentences = [None] * world_size
        dist.all_gather_object(sentences, str(err))
    assert sentences[0] is not None and sentences[0] == sentences[1] and "last failed on rank" in sentences[0]
    assert read_checked_metadata(out / "older") is not None  # the dropped removal kept it
    assert not any((out / name).exists() for name in ("failing", "next", "last"))
    assert not list(out.glob(".partial-*"))
    with strategy.saves_complete_on_return():  # SLURM's requeue save: complete when the call returns
        trainer.save_checkpoint(out / "hpc")
    assert read_checked_metadata(out / "hpc") is not None
    # The full form: rank 0 writes in the background, its disk runs full; every rank raises it at teardown.
    plugins = [_FullDiskCheckpointIO()]
    trainer = _trainer(FSDPStrategy(state_dict_type="full", async_save=True), 2, max_steps=1, plugins=plugins)
    torch.manual_seed(0)
    trainer.fit(LitGPT(), token_loader(4, 2))
    trainer.save_checkpoint(out / "full.ckpt")
    with pytest.raises(OSError, match=r"^\[Errno 28\] the background save to .*full.ckpt failed on rank 0 \(no space"):
        trainer.strategy.teardown()
    assert not (out / "full.ckpt").exists()


def test_a_background_failure_surfaces_at_the_next_save_and_at_teardown(tmp_path: Path) -> None:
    run_distributed(_failures_surface, 2, str(tmp_path), timeout=300)


def _killed_during_the_write(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=rank)
    saver = BackgroundSaver()
    saver.save(out / "ckpt", sharded_checkpoint_state(model, [optimizer]), {"global_step": 1})
    saver.wait()
    sharded_module.FileSystemWriter = _HeldWriter
    _HeldWriter.actions = [{"kill"}]
    train_tokens(model, optimizer, 1, seed=rank)
    saver.save(out / "ckpt", sharded_checkpoint_state(model, [optimizer]), {"global_step": 2})
    train_tokens(model, optimizer, 1, seed=rank)  # rank 1 is killed by its writer meanwhile
    saver.wait()


def _load_after_the_kill(rank: int, world_size: int, out_name: str) -> None:
    out = Path(out_name)
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=rank)
    assert load_sharded(out / "ckpt", model, [optimizer])["global_step"] == 1
    saver = BackgroundSaver()
    saver.save(out / "ckpt", sharded_checkpoint_state(model, [optimizer]), {"global_step": 3})
    weights = full_state_dict(model)
    assert saver.close() is None
    assert not list(out.glob(".partial-*"))  # the killed write's temporary went with this save
    model, optimizer = _model()
    assert load_sharded(out / "ckpt", model, [optimizer])["global_step"] == 3
    reloaded = full_state_dict(model)
    for key, value in weights.items():
        torch.testing.assert_close(reloaded[key], value, rtol=0, atol=0, msg=key)


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1"):
        run_distributed(_killed_during_the_write, 2, str(tmp_path), timeout=120)
    assert torch.load(tmp_path / "ckpt" / "meta.pt", weights_only=True)["global_step"] == 1
    read_checked_metadata(tmp_path / "ckpt")
    run_distributed(_load_after_the_kill, 2, str(tmp_path), timeout=120)


def _fabric_saves_in_the_background(rank: int, world_size: int, out_name: str) -> None:
    """``fabric.save`` returns with the write held; the step after it changes the model, not the checkpoint; a
    second save waits for the first; teardown waits for the last; both load back as they were saved."""
    out = Path(out_name)
    _as_launched_rank(rank, world_size)
    sharded_module.FileSystemWriter = _HeldWriter
    _HeldWriter.actions = [{"hold"}]
    fabric = launch(FabricFSDPStrategy(async_save=True), world_size)
    _, _, (model, optimizer) = train(fabric, TinyLit, gpt_batches(rank, steps=1))
    fabric.save(out / "first", {"model": model, "optimizer": optimizer, "step": 1})
    first = weights(model)
    inputs, targets = gpt_batches(rank)[2][0]
    fabric.backward(model(inputs, targets))  # a step while the first write is held
    optimizer.step()
    assert _HeldWriter.entered.wait(timeout=120) and not (out / "first").exists()
    _HeldWriter.release.set()
    fabric.save(out / "second", {"model": model, "optimizer": optimizer, "step": 2})
    second = weights(model)
    fabric.strategy.teardown()
    for name, expected, step in (("first", first, 1), ("second", second, 2)):
        torch.manual_seed(1)
        other = TinyLit()
        other, other_optimizer = fabric.setup(other, adamw(other))
        state = {"model": other, "optimizer": other_optimizer, "step": 0}
        fabric.load(out / name, state)
        assert state["step"] == step
        loaded = weights(other)
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=f"{name}: {key}")
    assert not torch.equal(first["model.lm_head.weight"], second["model.lm_head.weight"])


def test_fabric_saves_in_the_background(tmp_path: Path) -> None:
    run_distributed(_fabric_saves_in_the_background, 2, str(tmp_path), timeout=300)


def test_async_save_refusals_are_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"async_save=True writes sharded checkpoints .* state_dict_type='sharded'"):
        FabricFSDPStrategy(async_save=True, state_dict_type="full")
    with pytest.raises(ValueError, match="async_save must be True or False"):
        FSDPStrategy(async_save="yes")
    with pytest.raises(ValueError, match=r"^asynchronous sharded saves write to local paths only, not s3://b/k;"):
        FSDPStrategy(state_dict_type="sharded", async_save=True)._save_sharded_in_background("s3://b/k", {}, {})


def test_the_cli_takes_async_save_as_a_typed_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = ["--config", str(CONFIGS / "demo.yaml"), "--trainer.strategy.init_args.async_save"]
    print_config([*flag, "true"], monkeypatch)
    assert "async_save: true" in capsys.readouterr().out
    with pytest.raises(AssertionError):  # the CLI exits with an error status
        print_config([*flag, "7"], monkeypatch)
    assert "async_save" in capsys.readouterr().err
