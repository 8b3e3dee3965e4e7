"""``myfsdp`` with the engine options that must not change the math, each against one DDP run, on 2 CPU processes.

Each case starts from seed 0 and the same data as the DDP reference, and rank 0 saves its full weights to
OUT_DIR/<case>.pt:

- cpu_offload, activation checkpointing, NO_SHARD, HYBRID_SHARD as (1, 2) by default and as (2, 1),
  _HYBRID_SHARD_ZERO2 (Lightning's name: SHARD_GRAD_OP inside the shard group);
- deferred init through ``trainer.init_module(empty_init=True)`` and through ``configure_model`` with
  ``FSDPStrategy(empty_init=True)``: the engine materializes the meta modules in module order after the strategy
  re-seeds, so it reproduces the eager init (the GPT's tied embedding included);
- ``configure_model`` by default, on the real device as in Lightning, and with "pretrained" weights loaded there
  (``load_state_dict`` of another seed's GPT), against DDP running the same ``configure_model`` (ddp_pretrained);
- no auto_wrap_policy: the default finds the GPT's blocks and makes each a unit (OUT_DIR/<case>.json: "units");
- sync_module_states: each rank starts from its own seed, and rank 0's weights must win, as DDP's do; without the
  option too (rank_seeded_without_sync): the engine finds the values differ and takes rank 0's, as DDP does;
- manual optimization with two optimizers, two forwards and two backwards in one training_step (a GAN's shape),
  against DDP doing the same (ddp_manual);
- each rank a simulated host of its own (``LIGHTNING_FSDP_HOST``), the GPT untied: the gathers cross hosts, so the
  input embedding is gathered by the rows its lookups read and its gradient sent by rows, with a validation at the
  end, against DDP on the same untied GPT (ddp_untied).

OUT_DIR/<case>.json records whether the model was on the meta device before setup, and how many elements the
optimizer steps on rank 0.

Usage: python tests/scripts/strategy_engine_options.py OUT_DIR
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import lightning as L
import torch
from strategy_common import TINY, LitGPT, make_trainer, out_dir, token_loader, write_json

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.transport.hosts import HOST_SWITCH
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

STEPS = 4
LOCAL_BATCH = 2


class PretrainedInConfigureModel(LitGPT):
    """Builds the GPT in ``configure_model`` and loads weights of another seed into it, as ``from_pretrained``."""

    def __init__(self) -> None:
        super().__init__(in_configure_model=True)

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            torch.manual_seed(123)
            self.model.load_state_dict(GPT(self.config).state_dict())


class TwoOptimizers(LitGPT):
    """Manual optimization: the blocks and the rest each get their own optimizer, forward and backward per step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        for optimizer in self.optimizers():
            loss = self.model(batch[:, :-1], batch[:, 1:])
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = [p for name, p in self.named_parameters() if ".blocks." in name]
        rest = [p for name, p in self.named_parameters() if ".blocks." not in name]
        return [torch.optim.AdamW(params, lr=self.lr, eps=1e-5, weight_decay=0.1) for params in (blocks, rest)]


UNTIED = dataclasses.replace(TINY, tie_weights=False)


class OnHostsOfItsOwn(LitGPT):
    """The untied GPT, each rank claiming a simulated host of its own before the first forward picks transports."""

    def __init__(self) -> None:
        super().__init__(UNTIED)

    def setup(self, stage: str) -> None:
        os.environ[HOST_SWITCH] = f"simhost{self.global_rank}"

    def teardown(self, stage: str) -> None:
        os.environ.pop(HOST_SWITCH, None)


def run(case: str, strategy: Any, build: str = "eager") -> None:
    L.seed_everything(0)
    trainer = make_trainer(strategy, max_steps=STEPS)
    if build == "init_module":
        with trainer.init_module(empty_init=True):
            model = LitGPT()
    elif build == "configure_model":
        model = LitGPT(in_configure_model=True)
    elif build == "pretrained":
        model = PretrainedInConfigureModel()
    elif build == "manual":
        model = TwoOptimizers()
    elif build == "two_hosts":
        model = OnHostsOfItsOwn()
    elif build == "untied":
        model = LitGPT(UNTIED)
    elif build == "rank_seeded":
        L.seed_everything(trainer.global_rank)  # different weights on each rank until rank 0's are broadcast
        model = LitGPT()
        L.seed_everything(0)
    else:
        model = LitGPT()
    meta_before_fit = model.model is not None and next(model.parameters()).is_meta
    config = UNTIED if build in ("two_hosts", "untied") else TINY
    validation = token_loader(4, LOCAL_BATCH, config, seed=2) if config is UNTIED else None
    trainer.fit(model, token_loader(STEPS * LOCAL_BATCH * 2, LOCAL_BATCH, config), validation)
    state = trainer.strategy.lightning_module_state_dict() if not case.startswith("ddp") else model.state_dict()
    if trainer.global_rank == 0:
        torch.save(state, out_dir() / f"{case}.pt")
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    record = {
        "built_on_meta": meta_before_fit or getattr(model, "built_on_meta", False),
        "optimizer_numel": sum(p.numel() for p in params),
        "units": len(units_under(model)),
        "looked_up": sorted(rows.param.fqn for unit in units_under(model) for rows in unit.looked_up),
        "val_loss": float(trainer.callback_metrics["val_loss"]) if validation is not None else None,
    }
    write_json(trainer, f"{case}.json", record)


def main() -> None:
    blocks = {Block}
    run("ddp", "ddp")
    run("cpu_offload", FSDPStrategy(auto_wrap_policy=blocks, cpu_offload=True))
    run("activation_checkpointing", FSDPStrategy(auto_wrap_policy=blocks, activation_checkpointing_policy=blocks))
    run("no_shard", FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="NO_SHARD"))
    run("hybrid_default_mesh", FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="HYBRID_SHARD"))
    run("hybrid_2x1", FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1)))
    run("hybrid_zero2", FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="_HYBRID_SHARD_ZERO2"))
    run("init_module_empty_init", FSDPStrategy(auto_wrap_policy=blocks), build="init_module")
    run("configure_model", FSDPStrategy(auto_wrap_policy=blocks), build="configure_model")
    run("configure_model_empty_init", FSDPStrategy(auto_wrap_policy=blocks, empty_init=True), build="configure_model")
    run("ddp_pretrained", "ddp", build="pretrained")
    run("pretrained_in_configure_model", FSDPStrategy(), build="pretrained")
    run("default_policy", FSDPStrategy())
    run("sync_module_states", FSDPStrategy(auto_wrap_policy=blocks, sync_module_states=True), build="rank_seeded")
    run("ddp_manual", "ddp", build="manual")
    run("manual_two_optimizers", FSDPStrategy(auto_wrap_policy=blocks), build="manual")
    run("rank_seeded_without_sync", FSDPStrategy(auto_wrap_policy=blocks), build="rank_seeded")
    run("ddp_untied", "ddp", build="untied")
    run("two_hosts_untied", FSDPStrategy(auto_wrap_policy=blocks), build="two_hosts")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
