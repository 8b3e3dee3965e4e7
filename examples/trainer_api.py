"""Train the demo GPT through Lightning's Python API: ``Trainer(strategy=FSDPStrategy(...))`` on 2 CPU processes.

    python examples/trainer_api.py --max-steps 100

The same run as ``lightning-fsdp fit --config configs/demo.yaml``, written out in Python. Lightning starts the
second process itself by running this script again, so everything happens under ``if __name__ == "__main__"``.
``LitGPT`` builds its GPT in ``configure_model``; the strategy then makes every ``Block`` a sharding unit, and
from there on each rank holds, and its optimizer steps, only its own rows of every parameter.
"""

from __future__ import annotations

import argparse
import os

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.demos.lit_gpt import LitGPT
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--sharding-strategy",
        type=str.upper,
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        help="(default: %(default)s)",
    )
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--n-embd", type=int, default=128, help="a multiple of 4 (default: %(default)s)")
    parser.add_argument("--out", default="runs/trainer_api", help="logs and checkpoints (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(0)  # the same initial weights on both ranks; the sampler gives each rank different data
    strategy = FSDPStrategy(
        auto_wrap_policy={Block},  # every transformer block is one unit: gathered for its use, then freed
        sharding_strategy=args.sharding_strategy,
        state_dict_type="full",  # one checkpoint file, written by rank 0
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=min(50, args.max_steps),
        limit_val_batches=5,
        limit_test_batches=5,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,  # the norm of the whole, unsharded gradient
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=True)],
        log_every_n_steps=10,
    )
    model = LitGPT(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=64, lr=3e-3)
    data = CharDataModule(block_size=64, batch_size=16)
    trainer.fit(model, datamodule=data)
    # The model stays sharded after fit; testing runs on the shards, gathering one block at a time.
    (results,) = trainer.test(model, datamodule=data, verbose=False)
    if trainer.is_global_zero:
        print(f"test loss {results['test_loss']:.3f}, perplexity {results['test_ppl']:.2f}")
        print(f"checkpoint: {trainer.checkpoint_callback.last_model_path}")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
