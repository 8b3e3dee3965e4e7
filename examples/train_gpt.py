"""Train the demo GPT with ``fully_shard``, without Lightning: the engine on its own under ``torchrun``.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 60

(``bash scripts/demo.sh`` trains the same model through Lightning instead; see examples/trainer_api.py.)
Every rank builds the same model from the same seed, ``fully_shard`` cuts each ``Block`` (and the root, for
what the blocks leave over) into dim-0 shards, and from then on each rank holds and updates only its own rows.
The data parallelism is the other half: each rank draws different batches, and the engine averages the
gradients over the ranks.
On CPU the ranks talk over gloo; with CUDA each rank takes the GPU of its LOCAL_RANK and NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp import clip_grad_norm_, fully_shard
from lightning_fsdp.demos.corpus import VOCAB_SIZE, load_corpus, random_batches
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.runtime.process_exit import exit_now

N_HEAD = 4
BLOCK_SIZE = 64
MAX_GRAD_NORM = 1.0
WEIGHT_DECAY = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default: %(default)s)")
    parser.add_argument(
        "--sharding-strategy",
        type=str.upper,
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        help="(default: %(default)s)",
    )
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--n-embd", type=int, default=128, help=f"a multiple of {N_HEAD} (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.n_embd % N_HEAD:
        parser.error(f"--n-embd must be a multiple of the {N_HEAD} attention heads, got {args.n_embd}")
    return args


def init_distributed() -> torch.device:
    """Join torchrun's process group; returns this rank's device (its own GPU under CUDA, else the CPU)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build_optimizer(model: nn.Module, matrix_names: set[str], lr: float) -> torch.optim.AdamW:
    """AdamW that decays the named matrices (weights, embeddings) and not the biases or norm gains.

    The choice is made by name because the parameters the optimizer sees are local shards: their shapes say
    nothing reliable about the parameter they came from.
    """
    named = list(model.named_parameters())
    groups = [
        {"params": [p for name, p in named if name in matrix_names], "weight_decay": WEIGHT_DECAY},
        {"params": [p for name, p in named if name not in matrix_names], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks: the loss of the whole (global) batch, not just this rank's part."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        # The same seed on every rank gives every rank the same initial weights before sharding.
        torch.manual_seed(args.seed)
        config = GPTConfig(
            vocab_size=VOCAB_SIZE, block_size=BLOCK_SIZE, n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd
        )
        model = GPT(config).to(device)
        full_numel = sum(p.numel() for p in model.parameters())
        matrix_names = {name for name, p in model.named_parameters() if p.dim() >= 2}

        fully_shard(model, policy={Block}, sharding_strategy=args.sharding_strategy)
        local_numel = sum(p.numel() for p in model.parameters())
        optimizer = build_optimizer(model, matrix_names, args.lr)  # after sharding: it sees the local shards

        tokens = load_corpus()
        generator = torch.Generator().manual_seed(args.seed + rank)  # different batches on every rank
        losses: list[float] = []
        step_seconds: list[float] = []
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            inputs, targets = random_batches(tokens, args.batch_size, BLOCK_SIZE, generator)
            loss = model(inputs.to(device), targets.to(device))
            loss.backward()
            grad_norm = clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # the norm of the full gradient
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_seconds.append(time.perf_counter() - start)
            losses.append(mean_over_ranks(loss))
            if rank == 0:
                print(
                    f"step {step} | loss {losses[-1]:.4f} | grad-norm {grad_norm.item():.3f} | "
                    f"{step_seconds[-1] * 1000:.0f} ms",
                    flush=True,
                )

        if rank == 0:
            # The median leaves out the first step's one-off costs (lazy init, allocations).
            print(
                f"done: {args.steps} steps on {world_size} ranks ({args.sharding_strategy}), "
                f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, {statistics.median(step_seconds) * 1000:.0f} ms/step, "
                f"params {full_numel / 1e6:.2f}M ({local_numel / 1e6:.2f}M per rank)",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
