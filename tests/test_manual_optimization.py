"""Manual optimization under the Trainer on 2 real ranks, against ddp in the same setting: a GAN-style step (two
forwards, two backwards, two optimizers, all inside ``training_step``, so inside the root unit's forward) trains as
ddp does, every unit is sharded again at the batch end, a checkpoint there (``ModelCheckpoint`` every step, in
either form) is written and holds the step's weights (see [Note: backward inside a forward] in
engine/runtime/hooks.py), and ``FSDPMonitor`` follows a step count that moves by two a batch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fsdp import FSDPMonitor, FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.monitor import FILE_NAME
from tests.distributed import run_distributed
from tests.scripts.strategy_common import LitGPT, make_trainer, token_loader

BATCHES = 3  # each runs both optimizers: Lightning counts 2 steps a batch


class TwoOptimizers(LitGPT):
    """Blocks and the rest stepped by optimizers of their own, each after a forward and backward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        for optimizer in self.optimizers():
            loss = self.model(batch[:, :-1], batch[:, 1:])
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = [p for name, p in self.named_parameters() if ".blocks." in name]
        rest = [p for name, p in self.named_parameters() if ".blocks." not in name]
        return [torch.optim.AdamW(blocks, lr=1e-2, eps=1e-5), torch.optim.AdamW(rest, lr=5e-3, eps=1e-5)]


class ShardStates(L.Callback):
    """Each unit's state at every batch end, where checkpoints are written."""

    def __init__(self) -> None:
        self.states: list[list[str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.states.append([unit.shard_state.name for unit in units_under(pl_module)])


def _fit(rank: int, world_size: int, out: str) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": "2"})
    results: dict[str, Any] = {}
    for name in ("ddp", "full", "sharded"):
        strategy = "ddp" if name == "ddp" else FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=name)
        states = ShardStates()
        callbacks: list[L.Callback] = [states]
        if name != "ddp":
            folder = Path(out, name)
            callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1))
            callbacks.append(FSDPMonitor(every_n_steps=3, dirpath=str(folder)))
        torch.manual_seed(0)
        model = TwoOptimizers()
        trainer = make_trainer(strategy, max_steps=2 * BATCHES, callbacks=callbacks, enable_checkpointing=name != "ddp")
        trainer.fit(model, token_loader(4 * BATCHES, batch_size=2))
        weights = full_state_dict(model) if name != "ddp" else model.state_dict()
        if trainer.global_rank == 0:
            torch.save({key: value.detach().clone() for key, value in weights.items()}, Path(out, f"{name}.pt"))
            results[name] = {"states": states.states, "global_step": trainer.global_step}
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("manual")
    run_distributed(_fit, 2, str(out), timeout=300)
    return out


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_two_optimizers_inside_one_step_train_as_ddp(runs: Path, form: str) -> None:
    ddp, ours = torch.load(runs / "ddp.pt"), torch.load(runs / f"{form}.pt")
    assert ddp.keys() == ours.keys()
    for name, expected in ddp.items():
        torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_every_unit_is_sharded_again_at_each_batch_end(runs: Path, form: str) -> None:
    results = json.loads((runs / "results.json").read_text())[form]
    assert results["global_step"] == 2 * BATCHES
    assert len(results["states"]) == BATCHES
    for states in results["states"]:
        assert set(states) == {"SHARDED"}, results["states"]


def test_a_checkpoint_at_every_batch_end_holds_that_steps_weights(runs: Path) -> None:
    saved = sorted((runs / "full").glob("*.ckpt"))
    assert [path.name for path in saved] == [f"epoch=0-step={2 * batch}.ckpt" for batch in range(1, BATCHES + 1)]
    last = torch.load(saved[-1], weights_only=True)
    final = torch.load(runs / "full.pt")
    assert last["state_dict"].keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(last["state_dict"][name], value), name
    assert len(last["optimizer_states"]) == 2
    folders = sorted((runs / "sharded").glob("*.ckpt"))
    assert len(folders) == BATCHES and all((folder / "meta.pt").is_file() for folder in folders)


def test_the_monitor_reports_when_two_optimizers_step_past_its_interval(runs: Path) -> None:
    """Lightning's step count moves by 2 a batch here (2, 4, 6): an interval of 3 ends where it crosses 3 and 6."""
    lines = [json.loads(line) for line in (runs / "full" / FILE_NAME).read_text().splitlines()]
    intervals = [line for line in lines if line["kind"] == "interval"]
    assert [(line["step"], line["steps"]) for line in intervals] == [(4, 2), (6, 2)]
