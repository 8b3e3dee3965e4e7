"""How long a sharded save stops training, synchronous against asynchronous, and the memory the background one costs.

    python benchmarks/bench_async_save.py                              # ~98M params (untied), 2 ranks, ~2 minutes
    python benchmarks/bench_async_save.py --n-layer 2 --n-embd 384     # seconds, for a smoke test

What it runs: the demo GPT (``--n-layer`` 12, ``--n-embd`` 768, vocabulary 8192, head untied: 98M parameters) built
on the meta device and sharded with ``fully_shard``, AdamW, on ``--world-size`` gloo ranks with one thread each,
training on random tokens. Then, for each mode, ``--saves`` times: ``--steps-between`` training steps, then one save
of the model and optimizer into the same folder (as ``ModelCheckpoint``'s ``last`` does), timed on every rank from a
barrier to the call's return, the slowest rank counted:

- ``sync``: ``save_sharded``, what ``FSDPStrategy(state_dict_type="sharded")`` does: every rank writes until the
  checkpoint is published.
- ``async``: ``BackgroundSaver.save``, what ``async_save=True`` does: the call returns once this rank's part is
  copied to CPU memory; the write goes on while the next steps train, and the next save waits for it if it is not
  done (that wait counts in the next save's time). The last write is waited for before the memory runs.

Memory, per rank (the largest): ``peak RSS +`` is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) over one save and its write, with no training in between, minus the resident size
before it. The local shards and optimizer state (what one copy costs) are printed beside it. Every rank sets glibc's
``mmap`` threshold to 64 KiB first, so that a freed tensor's memory goes back to the kernel (by default glibc keeps
freed blocks of up to 32 MB in its heap after the first one is freed, and a later save's copy then lands in pages the
process already has, hiding its cost). ``waited`` is the part of an asynchronous save's time spent waiting for the
previous write.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

_REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("lightning_fsdp") is None:  # run from a checkout where the package is not installed
    sys.path.insert(0, str(_REPO_ROOT))

from lightning_fsdp import fully_shard  # noqa: E402
from lightning_fsdp.checkpoint.async_save import BackgroundSaver  # noqa: E402
from lightning_fsdp.checkpoint.atomic import tensor_bytes  # noqa: E402
from lightning_fsdp.checkpoint.sharded import save_sharded, sharded_checkpoint_state  # noqa: E402
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig  # noqa: E402
from lightning_fsdp.engine.state.state_dict import init_optimizer_state  # noqa: E402
from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

MB = 1e6
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_embd: int
    world_size: int
    saves: int
    steps_between: int
    folder: str
    timeout: float

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=8192, block_size=64, n_layer=self.n_layer, n_head=12, n_embd=self.n_embd, tie_weights=False
        )


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_rss_extra(block: Callable[[], None]) -> int:
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    block()
    return _status("VmHWM") - before


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _largest(nbytes: int) -> int:
    value = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _rank(rank: int, args: Args, port: int) -> None:
    faulthandler.enable()
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)  # see the module docstring
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=timeout)
    config = args.config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    fully_shard(model, {Block}, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init_optimizer_state(optimizer)
    data = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, config.vocab_size, (1, config.block_size + 1), generator=data)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    folder = Path(args.folder)
    saver = BackgroundSaver(timeout)
    modes: dict[str, Callable[[], None]] = {
        "sync": lambda: save_sharded(folder / "sync", sharded_checkpoint_state(model, [optimizer]), {"step": 0}),
        "async": lambda: saver.save(folder / "async", sharded_checkpoint_state(model, [optimizer]), {"step": 0}),
    }
    step()  # warm-up (and the optimizer's first step)
    started = time.perf_counter()
    step()
    step_seconds = _slowest(time.perf_counter() - started)
    blocked: dict[str, list[float]] = {}
    waited: dict[str, list[float]] = {}
    for mode, save in modes.items():
        blocked[mode], waited[mode] = [], []
        for _ in range(args.saves):
            for _ in range(args.steps_between):
                step()
            dist.barrier()
            started = time.perf_counter()
            saver.wait()  # the previous write (async; nothing to wait for in sync), which save() would wait for
            written = time.perf_counter()
            save()
            blocked[mode].append(_slowest(time.perf_counter() - started))
            waited[mode].append(_slowest(written - started))
        saver.wait()
    memory = {
        "sync": _largest(_peak_rss_extra(modes["sync"])),
        "async": _largest(_peak_rss_extra(lambda: (modes["async"](), saver.wait()))),
    }
    shards = _largest(tensor_bytes(sharded_checkpoint_state(model, [optimizer])))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) * args.world_size
        print(
            f"model: {params / 1e6:.0f}M parameters (sharded rows, all ranks), {args.world_size} ranks; one rank's "
            f"shards + optimizer state: {shards / MB:.0f} MB; a training step: {step_seconds:.2f} s; "
            f"{args.steps_between} steps between saves"
        )
        header = f"{'mode':<6} {'blocked, median (s)':>20} {'each save (s)':>22} {'waited (s)':>18}"
        print(f"{header} {'peak RSS + (MB)':>16}")
        for mode, times in blocked.items():
            each = ", ".join(f"{t:.2f}" for t in times)
            waits = ", ".join(f"{t:.2f}" for t in waited[mode])
            median = statistics.median(times)
            print(f"{mode:<6} {median:>20.2f} {each:>22} {waits:>18} {memory[mode] / MB:>16.0f}")
    dist.destroy_process_group()
    exit_now()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_async_save_") as folder:
        args = Args(
            options.n_layer,
            options.n_embd,
            options.world_size,
            options.saves,
            options.steps_between,
            folder,
            options.timeout,
        )
        spawn_with_deadline(_rank, args.world_size, (args, free_port()), args.timeout)


if __name__ == "__main__":
    main()
