"""What the checks that ranks agree cost: the model fingerprint at the first forward, the collective identities after.

    python benchmarks/bench_checks.py                  # the bench_engine default model, 2 gloo ranks, 1 thread each
    python benchmarks/bench_checks.py --preset tiny    # seconds

Each rank trains ``ours`` (FULL_SHARD) of ``benchmarks/bench_engine.py`` over the shared-memory transport and then
over gloo alone (``LIGHTNING_FSDP_SHARED_MEMORY=0``), and times, with ``time.perf_counter`` around the functions
themselves, every moment it spends in them: ``check_same_model`` (once, at the root's lazy init), and per collective
the identity stamp: written into a shared-memory slot's header and compared after the barrier, or written into the
last bytes of each rank's part of a gloo collective and compared after the wait (no collective of its own). A third
run over gloo with no stamps at all gives the baseline step time to compare with. Printed: the time per step in the
checks, the median step time, and their ratio (the target is under 1%).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench.config import CORPUS_BYTES, PRESETS, BenchArgs, parse_args  # noqa: E402
from engine_bench.trainees import build, train_step  # noqa: E402

from lightning_fsdp.demos.corpus import load_corpus, random_batches  # noqa: E402
from lightning_fsdp.engine import hooks  # noqa: E402
from lightning_fsdp.engine.transport import (
    identity,
    shm,  # noqa: E402
)
from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

SPENT: Counter[str] = Counter()


def _timed(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that every call adds its wall time to ``SPENT[label]``."""
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def _no_stamp(self: identity.Ledger, kind: str, nbytes: int, label: str) -> None:
    """No identity at all: the baseline the gloo row is compared with (this benchmark only)."""
    return None


def _rank(rank: int, world_size: int, port: int, args: BenchArgs, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    _timed(hooks, "check_same_model", "fingerprint")  # hooks imported the name: wrap it where it is called
    for name in ("as_bytes", "digest", "verify_bytes", "verify_digest"):
        _timed(identity.Stamp, name, "identity")
    _timed(shm.SharedMemoryTransport, "stamp", "identity")
    _timed(shm.SharedMemoryTransport, "verify", "identity")
    _timed(identity.Ledger, "stamp", "identity")
    tokens = load_corpus(max_bytes=CORPUS_BYTES)
    generator = torch.Generator().manual_seed(rank)
    lines = []
    timed_stamp = identity.Ledger.stamp
    for name, transport, stamp in (
        ("shared memory", "1", timed_stamp),
        ("gloo alone", "0", timed_stamp),
        ("gloo, unchecked", "0", _no_stamp),  # the baseline: what the step costs without stamps
    ):
        identity.Ledger.stamp = stamp
        os.environ[shm.ENV_SWITCH] = transport
        SPENT.clear()
        trainee = build("ours", args)
        optimizer = torch.optim.AdamW(trainee.model.parameters(), lr=args.lr, foreach=True)
        batches = [random_batches(tokens, args.batch_size, args.block_size, generator) for _ in range(2)]
        train_step(trainee, optimizer, batches[0], args)  # lazy init and warm-up
        fingerprint_s, SPENT["identity"] = SPENT["fingerprint"], 0.0
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            train_step(trainee, optimizer, batches[1], args)
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        identity_s = SPENT["identity"] / steps
        lines.append(
            f"rank {rank} {name:>15s}: step {step * 1e3:7.1f} ms | identity checks {identity_s * 1e3:6.2f} ms/step "
            f"= {identity_s / step:6.2%} | fingerprint once {fingerprint_s * 1e3:6.1f} ms "
            f"= {fingerprint_s / step:6.2%} of one step"
        )
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        Path(out).write_text("\n".join(line for rank_lines in gathered for line in rank_lines))
    dist.destroy_process_group()
    exit_now()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per transport")
    parser.add_argument("--world-size", type=int, default=2)
    options = parser.parse_args()
    args = parse_args(["--preset", options.preset, "--world-size", str(options.world_size)])
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "lines.txt"
        spawn_with_deadline(
            _rank, options.world_size, (options.world_size, free_port(), args, options.steps, str(out)), timeout=900
        )
        print(out.read_text())


if __name__ == "__main__":
    main()
