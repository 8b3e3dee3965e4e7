"""``torch.compile`` as users write it trains a sharded model with parity against eager, at a known graph-break cost.

The engine's hooks are kept out of traced graphs (see [Note: hooks stay out of compiled graphs] in hooks.py). The
backend is aot_eager: it runs dynamo and AOTAutograd -- where the hooks used to break compilation -- without
inductor's C++ compile, which takes minutes on these CPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT

STEPS = 3
# Graph breaks counted inside hook frames: none, since the hooks are partials of disabled functions, which dynamo
# skips without compiling a frame for them (see [Note: units compile with static sizes] in engine/runtime/hooks.py). As
# lambdas they were frames of their own, each broken at the call: 7 for the three-block tiny GPT, 8 with
# dynamic=False and 4 compiling each block, for the same 2 graphs; 69 with the hooks traced and dynamic=False.
GRAPH_BREAKS_IN_HOOK_FRAMES = 0


def _train(model: nn.Module, run: Callable[..., torch.Tensor], batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = run(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _sharded() -> nn.Module:
    torch.manual_seed(0)
    return fully_shard(GPT(TINY_GPT), {Block})


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _check_compile_parity(rank: int, world_size: int) -> None:
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=generator)]
    batches = batches * 2 + [torch.randint(0, TINY_GPT.vocab_size, (2, 9), generator=generator)]  # a new length
    eager = _sharded()
    reference = _train(eager, eager, batches)
    expected = {name: p.detach().clone() for name, p in eager.named_parameters()}

    def whole(model: nn.Module) -> Callable[..., torch.Tensor]:
        return torch.compile(model, backend="aot_eager")

    def method(model: nn.Module) -> Callable[..., torch.Tensor]:
        model.compile(backend="aot_eager", dynamic=False)
        return model

    def per_block(model: nn.Module) -> Callable[..., torch.Tensor]:
        for block in model.blocks:
            block.compile(backend="aot_eager")
        return model

    for label, compile_ in (("torch.compile(model)", whole), ("model.compile()", method), ("per block", per_block)):
        torch._dynamo.reset()
        counters.clear()
        model = _sharded()
        losses = _train(model, compile_(model), batches)
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=f"[{label}] losses")
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, expected[name], rtol=1e-5, atol=1e-6, msg=f"[{label}] {name}")
        breaks = _graph_breaks()
        assert counters["stats"]["unique_graphs"] > 0, f"[{label}] nothing was compiled"
        assert breaks == GRAPH_BREAKS_IN_HOOK_FRAMES, f"[{label}] {breaks} graph breaks: {counters['graph_break']}"


def test_compiled_models_train_like_eager() -> None:
    run_distributed(_check_compile_parity, 2, timeout=300.0)
