"""Communication overlaps computation on CUDA: in a profiled step, an all-gather kernel of NCCL runs on its own
stream while compute kernels of the unit before it run, and the engine's phases show in the trace by name.

World size 2 only: at W=1 nothing is gathered (a unit's shard is the whole parameter), so there is nothing to
overlap, and NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_fsdp.demos.gpt import GPT, GPTConfig
from tests.cuda.cuda_harness import cuda, shard_with, two_gpus
from tests.distributed import run_distributed

pytestmark = [*cuda, two_gpus]

#: The engine's record_function labels (lightning_fsdp/engine): every phase a profile must show by name.
PHASES = (
    "lightning_fsdp.unshard",
    "lightning_fsdp.wait_unshard",
    "lightning_fsdp.reshard",
    "lightning_fsdp.reduce_grads",
    "lightning_fsdp.wait_reduce",
)
# Big enough that one block's matmuls take longer than launching them, so a prefetched gather has compute to hide
# behind: 6 blocks of 12.6M parameters, 8 x 512 tokens per rank.
CONFIG = GPTConfig(vocab_size=256, block_size=512, n_layer=6, n_head=16, n_embd=1024)
BATCH = 8


def _intervals(events: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    return [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1)) for e in events]


def _overlapping(gathers: list[dict[str, Any]], compute: list[dict[str, Any]]) -> int:
    """How many all-gather kernels run, for part of their time, beside a compute kernel on another stream."""
    found = 0
    for start, end, stream in _intervals(gathers):
        if any(
            c_start < end and start < c_end and c_stream != stream for c_start, c_end, c_stream in _intervals(compute)
        ):
            found += 1
    return found


def _profile_a_step(rank: int, world_size: int, folder: str) -> None:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = shard_with(forward_prefetch=True, backward_prefetch="BACKWARD_PRE")(GPT(CONFIG).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), device=device)

    def step() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # the first step records the forward order that forward prefetching follows
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    trace_path = os.path.join(folder, f"rank{rank}.json")
    prof.export_chrome_trace(trace_path)
    events = json.loads(Path(trace_path).read_text())["traceEvents"]

    labels = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    missing = [phase for phase in PHASES if phase not in labels]
    assert not missing, f"rank {rank}: the profile shows no {missing}; engine labels seen: " + str(
        sorted(label for label in labels if label.startswith("lightning_fsdp"))
    )
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    gathers = [k for k in nccl if "allgather" in k["name"].lower().replace("_", "")]
    reduces = [k for k in nccl if "reducescatter" in k["name"].lower().replace("_", "")]
    compute = [k for k in kernels if "nccl" not in k["name"].lower()]
    assert gathers, (
        f"rank {rank}: no NCCL all-gather kernel in the step; NCCL kernels: {sorted({k['name'] for k in nccl})}"
    )
    assert reduces, f"rank {rank}: no NCCL reduce-scatter kernel in the step"
    gather_streams = {k["args"].get("stream") for k in gathers}
    compute_streams = {k["args"].get("stream") for k in compute}
    assert not gather_streams & compute_streams, (
        f"rank {rank}: all-gathers run on the compute streams {gather_streams & compute_streams}: no overlap possible"
    )
    # A unit's own compute waits for its gather, so compute running beside a gather belongs to another unit: the
    # one before it, whose forward (or backward) prefetching launched the gather of the next.
    overlapped = _overlapping(gathers, compute)
    assert overlapped >= 1, (
        f"rank {rank}: none of the {len(gathers)} all-gathers ran during compute; gathers at "
        f"{[(round(s), round(e)) for s, e, _ in _intervals(gathers)]}"
    )
    print(f"rank {rank}: {overlapped} of {len(gathers)} all-gathers overlapped compute kernels")


def test_the_all_gather_of_the_next_unit_runs_during_this_units_compute(tmp_path: Path) -> None:
    run_distributed(_profile_a_step, 2, str(tmp_path), backend="nccl", timeout=150.0)
