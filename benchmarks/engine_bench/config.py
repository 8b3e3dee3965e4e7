"""The benchmark's options: presets, the implementations it knows, and the picklable arguments every rank gets."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torch import nn

from lightning_fsdp.demos.corpus import VOCAB_SIZE
from lightning_fsdp.demos.gpt import MLP, Block, CausalSelfAttention, GPTConfig

from . import __doc__ as OVERVIEW

IMPLS = ("ours", "fsdp2", "ddp", "plain")  # plain: the module itself, no parallelism (world size 1 only)
DEFAULT_IMPLS = ("ours", "fsdp2", "ddp")

LLM_VOCAB = 8192  # the default vocabulary: real models' embedding and head are their largest tensors

PRESETS: dict[str, dict[str, int]] = {
    # ~25M parameters: large enough that communication and optimizer state matter, small enough for a
    # 2-core machine (one fp32 step takes seconds with one thread per rank).
    "default": {"n_layer": 8, "n_embd": 512, "n_head": 8, "block_size": 128, "batch_size": 4},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "batch_size": 4},
}

#: Relative tolerance on the final loss between implementations. fp32 differs only in reduction order;
#: bf16 also differs in where each implementation casts (FSDP: all-gather in bf16; DDP: autocast).
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2}

CORPUS_BYTES = 1_000_000

#: The engine's switch for its shared-memory transport ("0": everything over the process group's backend).
SHARED_MEMORY_SWITCH = "LIGHTNING_FSDP_SHARED_MEMORY"
TRANSPORTS = ("shm", "gloo")


@dataclass(frozen=True)
class BenchArgs:
    """Everything a rank needs, picklable so it can be handed to spawned processes."""

    impls: tuple[str, ...]
    world_size: int
    threads: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int
    warmup: int
    steps: int
    rounds: int
    precision: str
    sharding_strategy: str
    lr: float
    max_grad_norm: float
    seed: int
    profile: bool
    timeout: float
    json: str | None
    plot: str | None = None
    largest: bool = False
    budget_mib: float | None = None
    from_json: tuple[str, ...] = ()
    # One more untimed step under the profiler's memory events, for the step's peak (--largest uses it).
    peak: bool = False
    # Gather the next block during this one's forward: ours with forward_prefetch=True, FSDP2 with
    # set_modules_to_forward_prefetch (each its documented way); off by default in both.
    forward_prefetch: bool = False
    # The sharding units: every Block, or every Block's attention and MLP (smaller units, less gathered at once).
    wrap: str = "block"
    # torch.compile the whole (parallelised) model with this backend; None: eager.
    compile: str | None = None
    # Also run every implementation compiled with this backend, interleaved with the eager rounds.
    compiled_row: str | None = None
    # Ours' transport on one host: "shm" (shared memory, the default) or "gloo" (as between hosts).
    transport: str = "shm"
    # The embedding's rows and the head's. An LLM's proportions by default: the embedding and an untied head are
    # the largest tensors, both in the root unit (8192 rows at width 512: 8.4M of the parameters). The corpus needs
    # 256 (what the rest leave unused); GPT-2's 50257 makes them odd, so every rank's shard is padded.
    vocab_size: int = LLM_VOCAB
    tie_weights: bool = False

    def wrapped(self) -> set[type[nn.Module]]:
        return {Block} if self.wrap == "block" else {CausalSelfAttention, MLP}

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            tie_weights=self.tie_weights,
        )


def parse_args(argv: list[str] | None = None) -> BenchArgs:
    parser = argparse.ArgumentParser(description=OVERVIEW, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="model and batch sizes")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every implementation once")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--sharding-strategy",
        type=str.upper,
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        help="for ours (FSDP2 runs FULL_SHARD; DDP replicates)",
    )
    parser.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="prefetch the next block's parameters in forward, in ours and in fsdp2 (off by default in both)",
    )
    parser.add_argument(
        "--wrap",
        choices=["block", "sublayer"],
        default="block",
        help="sharding units, in ours and in fsdp2: each Block, or each Block's attention and MLP",
    )
    parser.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="torch.compile the whole model of every implementation with this backend (inductor, aot_eager)",
    )
    parser.add_argument(
        "--compiled-row",
        default=None,
        metavar="BACKEND",
        help="also run every implementation under torch.compile(model, backend=BACKEND), in the same rounds, and "
        "report compiled ours/fsdp2/ddp, compiled/eager and the graph breaks (inductor: minutes of compiling)",
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="shm",
        help="ours' collectives on one host: shared memory (default) or gloo only, as between hosts",
    )
    parser.add_argument(
        "--vocab",
        "--vocab-size",
        dest="vocab_size",
        type=int,
        default=LLM_VOCAB,
        help=f"embedding and head rows (at least the corpus' {VOCAB_SIZE}); 50257, GPT-2's, shards with padding",
    )
    parser.add_argument("--tied", action="store_true", help="tie the head to the embedding (GPT-2); default untied")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 disables it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (no comm time)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per (round, impl) before giving up")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number (and raw data) here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the results into this PNG (matplotlib)")
    parser.add_argument(
        "--largest",
        action="store_true",
        help="instead of the comparison: the largest model ours and DDP fit in --budget-mib, estimated and measured",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="per-rank budget for --largest (default: DDP's measured params+grads+optim on the chosen model)",
    )
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=(),
        metavar="PATH",
        help="run nothing: re-print (and --plot) these saved --json files (a comparison and/or a --largest run)",
    )
    ns = parser.parse_args(argv)

    sizes = {
        name: getattr(ns, name) if getattr(ns, name) is not None else value
        for name, value in PRESETS[ns.preset].items()
    }
    impls = tuple(name.strip() for name in ns.impls.split(",") if name.strip())
    if unknown := sorted(set(impls) - set(IMPLS)):
        parser.error(f"unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
    if "plain" in impls and ns.world_size != 1:
        parser.error("--impls plain (the module without parallelism) needs --world-size 1")
    if sizes["n_embd"] % sizes["n_head"]:
        parser.error(f"--n-embd {sizes['n_embd']} must be a multiple of --n-head {sizes['n_head']}")
    if ns.compile is not None and ns.compiled_row is not None:
        parser.error("--compile compiles every run already; --compiled-row adds compiled runs to eager ones: pick one")
    if ns.vocab_size < VOCAB_SIZE:
        parser.error(f"--vocab-size {ns.vocab_size} cannot embed the corpus' {VOCAB_SIZE} byte values")
    if ns.steps < 1 or ns.rounds < 1 or ns.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return BenchArgs(
        impls=impls,
        world_size=ns.world_size,
        threads=ns.threads,
        warmup=ns.warmup,
        steps=ns.steps,
        rounds=ns.rounds,
        precision=ns.precision,
        sharding_strategy=ns.sharding_strategy,
        lr=ns.lr,
        max_grad_norm=ns.max_grad_norm,
        seed=ns.seed,
        profile=not ns.no_profile,
        timeout=ns.timeout,
        json=ns.json,
        plot=ns.plot,
        largest=ns.largest,
        budget_mib=ns.budget_mib,
        from_json=tuple(ns.from_json),
        forward_prefetch=ns.forward_prefetch,
        vocab_size=ns.vocab_size,
        tie_weights=ns.tied,
        wrap=ns.wrap,
        compile=ns.compile,
        transport=ns.transport,
        compiled_row=ns.compiled_row,
        **sizes,
    )
