"""Train the demo GPT with Lightning Fabric on our engine: your own loop, ``Fabric(strategy="myfsdp")``.

    python examples/fabric_loop.py --steps 40                 # 2 CPU processes (Fabric starts the second)
    python examples/fabric_loop.py --resume out/fabric-ckpt   # continue from the checkpoint it wrote

``fabric.setup`` shards the model in place (each ``Block`` one unit, names unchanged) and hands the optimizer the
shards; ``fabric.backward`` and ``fabric.clip_gradients`` work on them (the clip norm is the whole gradient's);
``fabric.no_backward_sync`` skips the gradient reduction for all micro-batches but the last; ``fabric.save`` writes a
sharded checkpoint folder (``--state-dict-type full``: one file) that a Trainer with ``FSDPStrategy`` loads too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_fsdp  # noqa: F401  (registers "myfsdp" with Fabric)
from lightning_fsdp import FabricFSDPStrategy
from lightning_fsdp.demos.corpus import VOCAB_SIZE, load_corpus, random_batches
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (default: %(default)s)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--n-layer", type=int, default=2, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--n-embd", type=int, default=64, help="a multiple of 4 heads (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: %(default)s)")
    parser.add_argument("--precision", default="32-true", help="'32-true', 'bf16-mixed', ... (default: %(default)s)")
    parser.add_argument("--state-dict-type", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--out", type=Path, default=Path("out"), help="where the checkpoint goes (default: out)")
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint this example wrote")
    return parser.parse_args(argv)


def train(fabric: Fabric, args: argparse.Namespace) -> float:
    """The loop itself; returns the last step's loss (averaged over the ranks)."""
    fabric.seed_everything(0)  # the same initial weights on every rank (the engine checks that they agree)
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    with fabric.init_module(empty_init=args.resume is not None):  # no memory for weights a checkpoint replaces
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)  # sharded in place; the optimizer now holds the shards
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    tokens = load_corpus(max_bytes=200_000)
    generator = torch.Generator().manual_seed(1000 * fabric.global_rank + state["step"])  # each rank its own data
    loss = torch.zeros(())
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            inputs, targets = fabric.to_device(random_batches(tokens, args.batch_size, config.block_size, generator))
            # Reduce the gradients once per step, on the last micro-batch; the others accumulate locally.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(inputs, targets)
                fabric.backward(loss / args.accumulate)
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm of the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']} | loss {loss.item():.4f} | grad-norm {grad_norm.item():.3f}")

    path = args.out / ("fabric-ckpt" if args.state_dict_type == "sharded" else "fabric.ckpt")
    fabric.save(path, state)
    fabric.print(f"checkpoint: {path}")
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    strategy = FabricFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    train(fabric, args)


if __name__ == "__main__":
    main()
