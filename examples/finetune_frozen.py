"""Fine-tune the demo GPT with most of it frozen, sharded over 2 CPU processes.

    bash scripts/demo.sh                          # pre-training: writes runs/demo/checkpoints/last.ckpt
    python examples/finetune_frozen.py --freeze wte wpe blocks.0 blocks.1 --data-path my_text.txt

``LitGPT(pretrained=..., freeze=[...])`` loads the checkpoint's weights when the model is built and sets
``requires_grad=False`` on every parameter under the given name prefixes. Frozen parameters still have to be
gathered for the forward pass, but they get no gradients, no gradient reduce-scatter and no optimizer state,
so fine-tuning a few blocks costs a fraction of the memory and communication of training them all. The token
embedding is tied to the output head: freezing ``wte`` freezes both.
"""

from __future__ import annotations

import argparse
import os

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.demos.lit_gpt import LitGPT
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

ARCHITECTURE = ("n_layer", "n_head", "n_embd", "block_size", "bias")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pretrained",
        default="runs/demo/checkpoints/last.ckpt",
        help="a full LitGPT checkpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--freeze",
        nargs="+",
        default=["wte", "wpe", "blocks.0", "blocks.1"],
        help="parameter-name prefixes to freeze (default: %(default)s)",
    )
    parser.add_argument("--data-path", default=None, help="a text file to fine-tune on (default: the stdlib sources)")
    parser.add_argument("--max-steps", type=int, default=50, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--out", default="runs/finetune_example", help="logs and checkpoints (default: %(default)s)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.pretrained):
        parser.error(f"no checkpoint at {args.pretrained}; run `bash scripts/demo.sh` first or pass --pretrained")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(0)
    # The model must have the architecture the checkpoint was trained with; the checkpoint records it.
    hparams = torch.load(args.pretrained, map_location="cpu", weights_only=True)["hyper_parameters"]
    model = LitGPT(
        **{name: hparams[name] for name in ARCHITECTURE},
        lr=args.lr,
        warmup_steps=5,
        pretrained=args.pretrained,
        freeze=args.freeze,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full"),
        max_steps=args.max_steps,
        val_check_interval=min(25, args.max_steps),
        limit_val_batches=5,
        num_sanity_val_steps=0,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=True)],
        log_every_n_steps=5,
    )
    data = CharDataModule(path=args.data_path, block_size=hparams["block_size"], batch_size=16)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"fine-tuned with {', '.join(args.freeze)} frozen; val loss {trainer.callback_metrics['val_loss']:.3f}")
        print(f"checkpoint: {trainer.checkpoint_callback.last_model_path}")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
