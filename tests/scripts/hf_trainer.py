"""Fine-tuning a transformers Llama through the Trainer with ``myfsdp`` against ``ddp`` (2 processes).

OUT_DIR/pretrained is a tiny Llama saved with ``save_pretrained`` (the test writes it). Each run trains
``HFCausalLM`` (``lightning_fsdp.demos.hf_causal_lm``) for 4 steps (2 an epoch) on the same token batches, from seed
0, and rank 0 saves the final full weights to OUT_DIR/<run>.pt:

- ``ddp_rows`` / ``rows``: every parameter trained; the pretrained rows read after sharding (``load="rows"``).
- ``from_pretrained``: the same, loaded by ``from_pretrained`` in ``configure_model`` (compared with ``ddp_rows``).
- ``ddp_lora`` / ``lora``: LoRA adapters of rank 2 on q and v, everything else frozen (partly frozen units), with
  ``save_trainable_only=True``: the step-2 checkpoint (OUT_DIR/lora/epoch=0-step=2.ckpt) holds the adapters alone.
- ``lora_resumed``: a new run from the pretrained weights plus that adapter checkpoint, to step 4: it must end where
  ``lora`` did.
- ``ddp_peft`` / ``peft`` / ``peft_resumed``: the same with peft's ``get_peft_model`` LoRA (loaded by
  ``from_pretrained``; peft's own module names), the step-2 checkpoint in OUT_DIR/peft.

Usage: python tests/scripts/hf_trainer.py OUT_DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_common import make_trainer, out_dir
from torch.utils.data import DataLoader
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.hf_causal_lm import HFCausalLM
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

VOCAB, SEQUENCE = 61, 12


def loader() -> DataLoader:
    """8 sequences: with 2 ranks and a batch of 2, two steps an epoch, the same order every epoch."""
    tokens = torch.randint(0, VOCAB, (8, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return DataLoader(tokens, batch_size=2)


def run(name: str, strategy: Any, module: dict[str, Any], **trainer_options: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    out = out_dir()
    model = HFCausalLM(str(out / "pretrained"), lr=1e-3, **module)
    trainer = make_trainer(strategy, max_steps=4, **trainer_options)
    trainer.fit(model, loader())
    weights = full_state_dict(model) if isinstance(strategy, FSDPStrategy) else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out / f"{name}.pt")
    return trainer


def main() -> None:
    out = out_dir()
    units = {LlamaDecoderLayer}
    lora = {"lora_rank": 2}
    run("ddp_rows", "ddp", {})
    run("rows", FSDPStrategy(auto_wrap_policy=units), {})
    run("from_pretrained", FSDPStrategy(auto_wrap_policy=units), {"load": "from_pretrained"})
    run("ddp_lora", "ddp", lora)
    at_step_2 = ModelCheckpoint(dirpath=out / "lora", every_n_train_steps=2, save_top_k=-1)
    run(
        "lora",
        FSDPStrategy(auto_wrap_policy=units, save_trainable_only=True),
        lora,
        callbacks=[at_step_2],
        enable_checkpointing=True,
    )
    resume("lora_resumed", lora, out / "lora" / "epoch=0-step=2.ckpt")
    peft = {"lora_rank": 2, "adapters": "peft", "load": "from_pretrained"}
    run("ddp_peft", "ddp", peft)
    at_step_2 = ModelCheckpoint(dirpath=out / "peft", every_n_train_steps=2, save_top_k=-1)
    strategy = FSDPStrategy(auto_wrap_policy=units, save_trainable_only=True)
    run("peft", strategy, peft, callbacks=[at_step_2], enable_checkpointing=True)
    resume("peft_resumed", peft, out / "peft" / "epoch=0-step=2.ckpt")


def resume(name: str, module: dict[str, Any], checkpoint: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = HFCausalLM(str(out_dir() / "pretrained"), lr=1e-3, **module)
    trainer = make_trainer(FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}), max_steps=4)
    trainer.fit(model, loader(), ckpt_path=checkpoint)
    weights = full_state_dict(model)
    if trainer.global_rank == 0:
        torch.save(weights, out_dir() / f"{name}.pt")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()
