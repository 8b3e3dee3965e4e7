"""Checkpoint cost: time and rank 0's peak memory to save and load full vs sharded, and the memory of ``convert``.

    python benchmarks/bench_checkpoint.py                                  # ~101M params (404 MB fp32), 2 ranks
    python benchmarks/bench_checkpoint.py --n-layer 2 --n-embd 256         # seconds, for a smoke test

What it runs: the demo GPT built on the meta device and sharded with ``fully_shard`` unit by unit (so no rank
ever held the whole model before the measurements start), AdamW with its state created, on ``--world-size`` gloo
ranks with one thread each. Then, one after the other, each timed from a barrier to a barrier (the slowest rank):

- ``gather model``: ``full_state_dict`` alone, the model's part of a full save.
- ``full save``: what ``FSDPStrategy.save_checkpoint`` does for ``state_dict_type="full"``: model and optimizer
  gathered to rank 0's CPU, then ``save_full_checkpoint`` (``torch.save`` streaming into a temporary sibling,
  renamed into place).
- ``full save, CheckpointIO``: the same checkpoint written through Lightning's ``TorchCheckpointIO`` (what a user's
  ``checkpoint_io`` plugin path does), which serializes into memory first.
- ``sharded save``: ``save_sharded`` of the DTensor state dicts (every rank writes its own rows).
- ``full load`` / ``sharded load``: back into the same sharded model and optimizer, as ``load_checkpoint`` does.
- ``load_pretrained``: the model's weights from a safetensors file (rank 0 wrote it in the step before, from the
  gathered model) into the sharded model, each rank reading only its own rows; beside it ``whole model per rank``,
  what ``from_pretrained`` on every rank and then sharding costs: a whole model built on each rank, the file loaded
  into it, the sharded model's rows copied out of it.

Memory is rank 0's, in two columns. ``peak RSS +``: the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each step) minus the resident size just before it; it counts the pages of a
memory-mapped file the step touched, which the kernel can drop at any time. ``peak anon +``: anonymous memory (heap,
tensors; what an out-of-memory kill counts) sampled every 2 ms, minus its value before the step.

Then ``convert`` runs in a fresh process per direction (the offline tool: one process, no process group), with
the same two columns measured around the call, the process's imports excluded.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("lightning_fsdp") is None:  # run from a checkout where the package is not installed
    sys.path.insert(0, str(_REPO_ROOT))

from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from lightning_fsdp import fully_shard  # noqa: E402
from lightning_fsdp.checkpoint.atomic import write_file_atomically  # noqa: E402
from lightning_fsdp.checkpoint.convert import convert  # noqa: E402
from lightning_fsdp.checkpoint.full import (  # noqa: E402
    full_optimizer_state,
    load_full_optimizer_state,
    save_full_checkpoint,
)
from lightning_fsdp.checkpoint.pretrained import load_pretrained  # noqa: E402
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state  # noqa: E402
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig  # noqa: E402
from lightning_fsdp.engine.state.state_dict import full_state_dict, init_optimizer_state, load_full_state_dict  # noqa: E402
from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

MB = 1e6


@dataclass(frozen=True)
class Args:
    n_layer: int
    n_embd: int
    world_size: int
    folder: str
    timeout: float

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=256, block_size=256, n_layer=self.n_layer, n_head=8, n_embd=self.n_embd)


# ----- memory --------------------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@dataclass
class Peak:
    rss: int = 0  # VmHWM during the block minus VmRSS before it
    anon: int = 0  # sampled RssAnon peak minus RssAnon before it


@contextmanager
def peak_memory() -> Iterator[Peak]:
    """Measure this process's peak memory over the block (see the module docstring)."""
    gc.collect()
    result = Peak()
    rss_before, anon_before = _status("VmRSS"), _status("RssAnon")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    highest = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            highest[0] = max(highest[0], _status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        highest[0] = max(highest[0], _status("RssAnon"))
        result.rss = _status("VmHWM") - rss_before
        result.anon = highest[0] - anon_before


# ----- the ranks -----------------------------------------------------------------------------------------------------


def _build(args: Args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(args.config())
    fully_shard(model, {Block}, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_optimizer_state(optimizer)  # exp_avg and exp_avg_sq at the shards' shapes
    return model, optimizer


def _steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, config: GPTConfig
) -> dict[str, Callable[[], Any]]:
    """Each measured step, in order; rank 0 alone writes full checkpoints, every rank calls every step."""
    rank0 = dist.get_rank() == 0

    def full_checkpoint() -> dict[str, Any]:
        return {"state_dict": full_state_dict(model), "optimizer_states": [full_optimizer_state(model, optimizer)]}

    def full_save() -> None:
        checkpoint = full_checkpoint()
        if rank0:
            save_full_checkpoint(folder / "full.ckpt", checkpoint)

    def full_save_io() -> None:
        checkpoint = full_checkpoint()
        if rank0:
            io = TorchCheckpointIO()
            write_file_atomically(folder / "io.ckpt", lambda tmp: io.save_checkpoint(checkpoint, tmp))

    def full_load() -> None:
        checkpoint = torch.load(folder / "full.ckpt", map_location="cpu", mmap=True, weights_only=False)
        load_full_state_dict(model, checkpoint["state_dict"])
        load_full_optimizer_state(model, optimizer, checkpoint["optimizer_states"][0])

    def write_pretrained() -> None:
        weights = full_state_dict(model)
        if rank0:
            del weights["lm_head.weight"]  # tied to wte.weight: a pretrained file stores it once
            save_file(weights, folder / "pretrained.safetensors")

    def whole_model_per_rank() -> None:
        whole = GPT(config)  # what from_pretrained builds on every rank before the model can be sharded
        whole.load_state_dict(load_file(folder / "pretrained.safetensors"), strict=False)  # lm_head: tied to wte
        load_full_state_dict(model, whole.state_dict())

    return {
        "gather model": lambda: full_state_dict(model),
        "full save": full_save,
        "full save, CheckpointIO": full_save_io,
        "sharded save": lambda: save_sharded(
            folder / "sharded", sharded_checkpoint_state(model, [optimizer]), {"global_step": 0}
        ),
        "full load": full_load,
        "sharded load": lambda: load_sharded(folder / "sharded", model, [optimizer]),
        "write safetensors (rank 0)": write_pretrained,
        "load_pretrained (own rows)": lambda: load_pretrained(model, folder / "pretrained.safetensors"),
        "whole model per rank": whole_model_per_rank,
    }


def _rank(rank: int, args: Args, port: int) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=timedelta(seconds=args.timeout))
    model, optimizer = _build(args)
    folder = Path(args.folder)
    rows = []
    for name, step in _steps(model, optimizer, folder, args.config()).items():
        dist.barrier()
        with peak_memory() as peak:
            start = time.perf_counter()
            step()
            dist.barrier()
            seconds = time.perf_counter() - start
        rows.append({"step": name, "seconds": seconds, "peak_rss": peak.rss, "peak_anon": peak.anon})
    if rank == 0:
        (folder / "ranks.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py


def run_ranks(args: Args) -> list[dict[str, Any]]:
    spawn_with_deadline(_rank, args.world_size, (args, free_port()), args.timeout)
    return json.loads((Path(args.folder) / "ranks.json").read_text())


# ----- convert, one fresh process per direction ----------------------------------------------------------------------


def _convert_child(src: str, dst: str, to: str, result: str) -> None:
    with peak_memory() as peak:
        start = time.perf_counter()
        convert(src, dst, to, strip_prefix="", quiet=True)
        seconds = time.perf_counter() - start
    Path(result).write_text(json.dumps({"seconds": seconds, "peak_rss": peak.rss, "peak_anon": peak.anon}))


def run_convert(folder: Path, src: str, dst: str, to: str) -> dict[str, Any]:
    result = folder / f"convert-{dst}.json"
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_convert_child, args=(str(folder / src), str(folder / dst), to, str(result)))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"convert {src} -> {dst} exited with {child.exitcode}")
    return {"step": f"convert {src} -> {to}", **json.loads(result.read_text())}


# ----- the table -----------------------------------------------------------------------------------------------------


def sizes(config: GPTConfig) -> tuple[int, int]:
    """(bytes of the full fp32 model, bytes of its largest tensor)."""
    with torch.device("meta"):
        model = GPT(config)
    tensors = list(model.state_dict().values())
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values()), max(
        t.numel() * t.element_size() for t in tensors
    )


def report(rows: list[dict[str, Any]], args: Args, model_bytes: int, largest: int) -> list[str]:
    checkpoint_bytes = 3 * model_bytes  # the weights, AdamW's exp_avg and exp_avg_sq
    lines = [
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd}: {model_bytes / 4 / 1e6:.1f}M params, model "
        f"{model_bytes / MB:.0f} MB fp32, full checkpoint with AdamW state ~{checkpoint_bytes / MB:.0f} MB, largest "
        f"tensor {largest / MB:.1f} MB; {args.world_size} gloo ranks, 1 thread each",
        "",
        f"| {'step':<34} | {'time':>7} | {'peak RSS +':>10} | {'peak anon +':>11} | {'anon / model':>12} |",
        f"|{'-' * 36}|{'-' * 9}|{'-' * 12}|{'-' * 13}|{'-' * 14}|",
    ]
    for row in rows:
        lines.append(
            f"| {row['step']:<34} | {row['seconds']:>5.2f} s | {row['peak_rss'] / MB:>7.0f} MB | "
            f"{row['peak_anon'] / MB:>8.0f} MB | {row['peak_anon'] / model_bytes:>11.2f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    options = parser.parse_args(argv)
    # Every allocation above 64 kB its own mapping, returned to the system when freed: otherwise glibc reuses freed
    # heap that still counts as resident, and a step's increase of RSS understates what it allocated.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned processes' C library at start-up
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMPDIR")) as folder:
        args = Args(options.n_layer, options.n_embd, options.world_size, folder, options.timeout)
        model_bytes, largest = sizes(args.config())
        rows = run_ranks(args)
        for src, dst, to in (
            ("sharded", "weights.safetensors", "safetensors"),
            ("full.ckpt", "full-weights.safetensors", "safetensors"),
            ("sharded", "consolidated.ckpt", "full"),
        ):
            rows.append(run_convert(Path(folder), src, dst, to))
        print("\n".join(report(rows, args, model_bytes, largest)))


if __name__ == "__main__":
    main()
