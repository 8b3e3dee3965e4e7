"""One GPU, bf16: ours against torch FSDP2 and the plain module on a Llama-style model of 1.1B parameters.

    python benchmarks/bench_gpu.py                     # CUDA, W=1: step time, tokens/s, peak memory; one table
    python benchmarks/bench_gpu.py --junit cuda.xml    # also a row with the CUDA tests' results (pytest --junitxml)
    python benchmarks/bench_gpu.py --smoke             # CPU, gloo, a tiny Llama: checks the table is produced

``scripts/gpu_check.sh`` runs it after the tests marked ``cuda``. Why it is built this way:

- The model is ``transformers``' ``LlamaForCausalLM`` built from a ``LlamaConfig`` of TinyLlama's shape (22 layers,
  hidden 2048, grouped-query attention with 4 KV heads, vocabulary 32000): 1.1B parameters, nothing downloaded.
  It is built directly on the device with fp32 weights (the optimizer's master weights under all three).
- bf16 the way each implementation does it: ours ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``, FSDP2
  ``MixedPrecisionPolicy`` with the same dtypes, the plain module ``torch.autocast``. Each shards every
  ``LlamaDecoderLayer`` and then the root. The same seed, data and AdamW (fused off, foreach on) everywhere, so
  the losses must agree (within bf16's rounding); a disagreement fails the run.
- W=1 on one GPU (a one-rank NCCL group): the engine's overhead against the plain module is what it measures,
  and FSDP2 is measured in the same conditions. Each implementation runs in its own fresh process, so
  ``torch.cuda.max_memory_allocated`` is its own peak.
- Step time is wall time between ``torch.cuda.synchronize()`` calls, the median over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Run as a script from a checkout where the package is not installed: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

IMPLS = ("ours", "fsdp2", "plain")
TITLES = {"ours": "ours", "fsdp2": "torch FSDP2", "plain": "plain module"}
LOSS_RTOL = 3e-2  # bf16: the implementations cast in different places (as in benchmarks/engine_bench/config.py)


@dataclass(frozen=True)
class Setup:
    """Everything a benchmark process needs (picklable)."""

    device: str  # "cuda" or "cpu"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int
    warmup: int
    steps: int
    timeout: float

    @staticmethod
    def for_gpu() -> Setup:
        return Setup("cuda", 2048, 5632, 22, 32, 4, 32000, batch=4, seq=1024, warmup=3, steps=10, timeout=120)

    @staticmethod
    def for_smoke() -> Setup:
        return Setup("cpu", 64, 128, 2, 4, 2, 256, batch=2, seq=32, warmup=1, steps=2, timeout=180)


def build(impl: str, setup: Setup, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The Llama, parallelised by ``impl``; returns it and the context its forward runs in."""
    from contextlib import nullcontext

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=setup.vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.intermediate,
        num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads,
        num_key_value_heads=setup.kv_heads,
        max_position_embeddings=setup.seq,
    )
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    if impl == "ours":
        from lightning_fsdp import MixedPrecision, fully_shard

        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return fully_shard(model, {LlamaDecoderLayer}, mixed_precision=policy), nullcontext()
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fsdp2_fully_shard(layer, mp_policy=policy)
        return fsdp2_fully_shard(model, mp_policy=policy), nullcontext()
    return model, torch.autocast(device.type, dtype=torch.bfloat16)


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak: allocated CUDA memory on a GPU, resident memory (Linux: KiB) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(rank: int, impl: str, setup: Setup, port: int, out: str) -> None:
    """One implementation in this fresh process: train, time, and write the numbers to ``out``."""
    device = torch.device(setup.device, 0) if setup.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=1, timeout=timedelta(seconds=setup.timeout))
    model, autocast = build(impl, setup, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    data = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(setup.warmup + setup.steps):
        tokens = torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=data).to(device)
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= setup.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {
        "impl": impl,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": statistics.median(times),
        "tokens_per_s": setup.batch * setup.seq / statistics.median(times),
        "peak_bytes": peak_memory_bytes(device),
        "losses": losses,
    }
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py


def run(impl: str, setup: Setup) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        spawn_with_deadline(measure, 1, (impl, setup, free_port(), out), setup.timeout)
        return json.loads(Path(out).read_text())


def pytest_counts(junit: Path) -> str:
    """ "N passed, M failed, K skipped" from a pytest --junitxml report."""
    suite = ElementTree.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None, f"{junit} holds no testsuite"
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped"


def table(results: dict[str, dict[str, Any]], setup: Setup, tests: str | None) -> list[str]:
    """The one summary table (markdown), and the lines that say what it measured."""
    ours, fsdp2, plain = (results[impl] for impl in IMPLS)
    memory = "peak CUDA memory allocated" if setup.device == "cuda" else "peak RSS"
    rows: list[tuple[str, str, str, str, str, str]] = []

    def row(title: str, key: str, scale: float, fmt: str, higher_is_better: bool = False) -> None:
        a, b, c = (r[key] * scale for r in (ours, fsdp2, plain))
        rows.append((title, format(a, fmt), format(b, fmt), format(c, fmt), f"{a / b:.2f}", f"{a / c:.2f}"))

    row("step time, median (ms)", "step_s", 1e3, ".0f")
    row("tokens / s", "tokens_per_s", 1, ".0f")
    row(f"{memory} (GiB)", "peak_bytes", 2**-30, ".2f")
    last = len(ours["losses"])
    rows.append((f"loss at step {last}", *(f"{r['losses'][-1]:.4f}" for r in (ours, fsdp2, plain)), "", ""))
    if tests is not None:
        rows.append(("CUDA tests (pytest -m cuda tests/cuda)", tests, "", "", "", ""))
    header = ("", *(TITLES[impl] for impl in IMPLS), "ours / FSDP2", "ours / plain")
    lines = [
        f"Llama-style model, {_count(ours['params'])} parameters ({setup.layers} layers, hidden {setup.hidden}), "
        f"bf16, W=1 on {setup.device}, batch {setup.batch} x {setup.seq} tokens, median of {setup.steps} steps "
        f"after {setup.warmup}:",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def losses_disagree(results: dict[str, dict[str, Any]]) -> str | None:
    """Why the losses say an implementation is wrong, or None."""
    reference = results["plain"]["losses"]
    for impl in ("ours", "fsdp2"):
        for step, (mine, theirs) in enumerate(zip(results[impl]["losses"], reference, strict=True)):
            if abs(mine - theirs) > LOSS_RTOL * abs(theirs):
                return f"{impl}'s loss at step {step + 1} is {mine:.5f}, the plain module's {theirs:.5f}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU, to check the script itself")
    parser.add_argument("--junit", type=Path, default=None, help="pytest --junitxml report to summarise in the table")
    parser.add_argument("--json", type=Path, default=None, help="write the setup and every number here")
    ns = parser.parse_args()
    setup = Setup.for_smoke() if ns.smoke else Setup.for_gpu()
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench_gpu: torch {torch.__version__} sees no CUDA device; run with --smoke on a CPU")
    results = {}
    for impl in IMPLS:
        start = time.monotonic()
        results[impl] = run(impl, setup)
        print(f"{impl}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print("\n".join(table(results, setup, pytest_counts(ns.junit) if ns.junit else None)), flush=True)
    if ns.json is not None:
        ns.json.write_text(json.dumps({"setup": asdict(setup), "results": results}, indent=1))
    if why := losses_disagree(results):
        raise SystemExit(f"bench_gpu: the implementations disagree: {why}")


if __name__ == "__main__":
    main()
