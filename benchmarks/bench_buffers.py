"""What broadcasting the buffers before every forward (DDP's ``broadcast_buffers=True``) would cost our engine.

    python benchmarks/bench_buffers.py                 # the suite's ResNet and a wider one, 2 gloo ranks

Each rank trains the ResNet of ``tests/conv_nets.py`` sharded per block, FULL_SHARD, SGD, and alternates blocks of
steps without and with ``broadcast_buffers(model)`` (rank 0's running statistics to every rank, one broadcast per
dtype, as DDP packs them) before each forward, so that both see the same machine load. Printed per model: the
buffers' size, the median step time of each, and the median time of the broadcast alone. benchmarks/README.md has
the numbers, docs/checkpoints.md the rule: the engine broadcasts at checkpoints only (see [Note: buffers are rank
0's at every checkpoint] in lightning_fsdp/engine/module_buffers.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fsdp import fully_shard  # noqa: E402
from lightning_fsdp.engine.features.module_buffers import broadcast_buffers  # noqa: E402
from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline  # noqa: E402
from tests.conv_nets import BasicBlock, ResNet  # noqa: E402

MODELS = {
    "suite ResNet (8/12/16 channels, 16x16 images, batch 4)": (((8, 1), (12, 2), (16, 2)), 16, 4),
    "wider ResNet (32/64/128/256 channels, 32x32 images, batch 16)": (((32, 1), (64, 2), (128, 2), (256, 2)), 32, 16),
}
BLOCKS, STEPS_PER_BLOCK = 6, 5


def _rank(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(600)
    )
    for label, (widths, size, batch) in MODELS.items():
        torch.manual_seed(0)
        model = fully_shard(ResNet(widths=widths), {BasicBlock})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        data = torch.Generator().manual_seed(rank)
        times: dict[bool, list[float]] = {False: [], True: []}
        broadcasts: list[float] = []
        for block in range(BLOCKS * 2 + 1):
            broadcast = block % 2 == 1
            for _ in range(STEPS_PER_BLOCK):
                images = torch.randn(batch, 3, size, size, generator=data)
                labels = torch.randint(0, 5, (batch,), generator=data)
                dist.barrier()
                start = time.perf_counter()
                if broadcast:
                    broadcast_buffers(model)
                    broadcasts.append(time.perf_counter() - start)
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                optimizer.zero_grad()
                if block > 0:  # the first block warms up
                    times[broadcast].append(time.perf_counter() - start)
        if rank == 0:
            nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
            plain, synced = statistics.median(times[False]), statistics.median(times[True])
            print(
                f"{label}: buffers {nbytes / 1024:.1f} KiB; step {plain * 1e3:.2f} ms without, {synced * 1e3:.2f} ms "
                f"with the broadcast ({(synced / plain - 1) * 100:+.1f}%); broadcast alone "
                f"{statistics.median(broadcasts) * 1e3:.3f} ms",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_with_deadline(_rank, 2, (2, free_port()), timeout=900.0)
