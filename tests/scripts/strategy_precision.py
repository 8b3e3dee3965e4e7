"""``myfsdp`` under each precision setting that changes dtypes, on 2 CPU processes.

- bf16-mixed: the tiny GPT memorises one batch per rank; records the losses, the dtypes of the optimizer's shards,
  of the blocks' computation and of the weights a checkpoint would hold.
- 16-mixed: rank 1 puts an inf into one of its gradient shards at batch INF_BATCH; every rank records, per batch,
  whether its shards changed and the loss scale, to OUT_DIR/fp16.json.rank<r>.
- bf16-true: the model itself is bf16.

Usage: python tests/scripts/strategy_precision.py OUT_DIR
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from strategy_common import LitGPT, make_trainer, token_loader, write_json
from torch import nn

from lightning_fsdp import FSDPPrecision, FSDPStrategy, ShardedGradScaler
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

INF_BATCH = 2


class PrecisionRecord(L.Callback):
    """Per batch: the loss, whether this rank's shards changed, the loss scale; and the compute dtype once."""

    def __init__(self, inject_inf_at: int | None = None) -> None:
        self.inject_inf_at = inject_inf_at
        self.losses: list[float] = []
        self.stepped: list[bool] = []
        self.scales: list[float] = []
        self.compute_dtypes: set[str] = set()
        self._before: torch.Tensor | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        linear = next(m for m in pl_module.modules() if isinstance(m, Block)).attn.qkv

        def record_dtype(module: nn.Module, args: Any) -> None:
            self.compute_dtypes.add(str(module.weight.dtype))

        linear.register_forward_pre_hook(record_dtype)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._before = _shards(trainer).clone()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and len(self.losses) == self.inject_inf_at:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None and p.grad.numel() > 0)
            grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.stepped.append(not torch.equal(self._before, _shards(trainer)))
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)

    def as_json(self, trainer: L.Trainer) -> dict[str, Any]:
        params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        return {
            "losses": self.losses,
            "stepped": self.stepped,
            "scales": self.scales,
            "compute_dtypes": sorted(self.compute_dtypes),
            "master_dtypes": sorted({str(p.dtype) for p in params}),
        }


def _shards(trainer: L.Trainer) -> torch.Tensor:
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def run(name: str, strategy: FSDPStrategy, steps: int, samples: int, every_rank: bool = False, **kwargs: Any) -> None:
    L.seed_everything(0)
    record = PrecisionRecord(inject_inf_at=INF_BATCH if name == "fp16" else None)
    trainer = make_trainer(strategy, max_steps=steps, callbacks=[record], **kwargs)
    trainer.fit(LitGPT(lr=1e-2), token_loader(samples, batch_size=2))
    state = trainer.strategy.lightning_module_state_dict()  # a collective; the full weights on rank 0 only
    saved_dtypes = sorted({str(value.dtype) for value in state.values()})
    write_json(trainer, f"{name}.json", {**record.as_json(trainer), "saved_dtypes": saved_dtypes}, every_rank)


def main() -> None:
    blocks = {Block}
    # 4 samples: one batch per rank, seen every step, so the loss must fall.
    run("bf16_mixed", FSDPStrategy(auto_wrap_policy=blocks), steps=12, samples=4, precision="bf16-mixed")
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1000)
    fp16 = FSDPStrategy(auto_wrap_policy=blocks, precision_plugin=FSDPPrecision("16-mixed", scaler=scaler))
    run("fp16", fp16, steps=6, samples=24, every_rank=True, gradient_clip_val=1.0)  # clipping after unscaling
    run("bf16_true", FSDPStrategy(auto_wrap_policy=blocks), steps=3, samples=12, precision="bf16-true")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
