"""Train the tiny GPT with ``strategy="ddp"`` and with ``myfsdp`` in several configurations, on 2 CPU processes.

Every case starts from the same seed and sees the same data; rank 0 saves the full weights of each to
OUT_DIR/<case>.pt, and what it recorded about communication to OUT_DIR/<case>.json.
tests/test_strategy_parity.py compares them.

Usage: python tests/scripts/strategy_parity.py OUT_DIR
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from strategy_common import LitGPT, make_trainer, out_dir, token_loader, write_json
from torch._dynamo.utils import counters

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

STEPS = 4
LOCAL_BATCH = 2
CLIP = 0.05  # well below the tiny model's gradient norm, so clipping acts on every step
CLIP_VALUE = 1e-3  # below the largest gradient elements
COMPILER = "aot_eager"  # dynamo and AOTAutograd, where hooks break compilation, without inductor's minutes of C++


class CommunicationRecord(L.Callback):
    """Records how many elements the optimizer steps on this rank, and each training batch's gradient reductions
    (reduce-scatters; gloo has none, so the engine issues an all-to-all there). Collectives are not counted for
    compiled modules: dynamo runs frames eagerly while a dispatch mode such as the counter is active."""

    def __init__(self, count_collectives: bool) -> None:
        self.counter = CollectiveCounter() if count_collectives else None
        self.optimizer_numel = 0
        self.reductions_per_batch: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        self.optimizer_numel = sum(p.numel() for p in params)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.counter is not None:
            self.counter.reset()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.reductions_per_batch.append(self.counter.counts["reduce_scatter"] + self.counter.counts["all_to_all"])


class CompiledGPT(LitGPT):
    """How users compile: the whole LightningModule (``trainer.fit(torch.compile(model))``), whose training step
    then must not call ``self.log`` (dynamo fails on Lightning 2.6's ``log`` under torch 2.13, with ddp too), or
    only the network inside it, which may log."""

    def __init__(self, compile_network: bool) -> None:
        super().__init__()
        if compile_network:
            self.model = torch.compile(self.model, backend=COMPILER)
        self.compile_network = compile_network

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.compile_network:
            return super().training_step(batch, batch_idx)
        return self.model(batch[:, :-1], batch[:, 1:])


def build(compiled: str | None) -> L.LightningModule:
    if compiled is None:
        return LitGPT()
    if compiled == "module":
        return torch.compile(CompiledGPT(compile_network=False), backend=COMPILER)
    return CompiledGPT(compile_network=True)


def run(
    case: str,
    strategy: Any,
    accumulate: int = 1,
    clip: float | None = None,
    clip_by: str = "norm",
    compiled: str | None = None,
) -> None:
    L.seed_everything(0)
    torch._dynamo.reset()  # compile each case afresh, so that its counters below are its own
    counters.clear()
    model = build(compiled)
    record = CommunicationRecord(count_collectives=compiled is None)
    trainer = make_trainer(
        strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_by,
        callbacks=[record],
    )
    trainer.fit(model, token_loader(STEPS * accumulate * LOCAL_BATCH * 2, LOCAL_BATCH))
    if isinstance(strategy, FSDPStrategy):
        state = trainer.strategy.lightning_module_state_dict()  # a collective: every rank calls it
    else:
        state = model.state_dict()
    state = {name.replace("_orig_mod.", ""): value for name, value in state.items()}  # names as if not compiled
    if trainer.global_rank == 0:
        torch.save(state, out_dir() / f"{case}.pt")
    record_json = {
        "optimizer_numel": record.optimizer_numel,
        "reductions_per_batch": record.reductions_per_batch,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    write_json(trainer, f"{case}.json", record_json)


def main() -> None:
    blocks = {Block}
    run("ddp", "ddp")
    run("full_shard", FSDPStrategy(auto_wrap_policy=blocks))
    run("shard_grad_op", FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="SHARD_GRAD_OP"))
    run("ddp_clip", "ddp", clip=CLIP)
    run("full_shard_clip", FSDPStrategy(auto_wrap_policy=blocks), clip=CLIP)
    run("ddp_clip_value", "ddp", clip=CLIP_VALUE, clip_by="value")
    run("full_shard_clip_value", FSDPStrategy(auto_wrap_policy=blocks), clip=CLIP_VALUE, clip_by="value")
    run("ddp_accumulate", "ddp", accumulate=2)
    run("full_shard_accumulate", FSDPStrategy(auto_wrap_policy=blocks), accumulate=2)
    no_sync = FSDPStrategy(auto_wrap_policy=blocks, sync_grads_each_micro_batch=False)
    run("full_shard_accumulate_no_sync", no_sync, accumulate=2)
    run("full_shard_compiled_module", FSDPStrategy(auto_wrap_policy=blocks), compiled="module")
    run("full_shard_compiled_network", FSDPStrategy(auto_wrap_policy=blocks), compiled="network")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
