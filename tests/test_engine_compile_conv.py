"""``torch.compile`` of a sharded ResNet whose blocks differ in shape: each block compiles with the sizes and ints of
its own modules as constants, as plain torch compiles them (see [Note: units compile with static sizes] in
engine/runtime/hooks.py), nothing recompiles after the first step, and training matches eager.

The backend is aot_eager wrapped in a recorder: dynamo and AOTAutograd run as they do for inductor, without
inductor's C++ compile (minutes on these CPUs). The recorder lists, for every graph, the sources of its symbolic
sizes: before the fix the second block's graph had ``L['self']._modules['conv1'].stride[0]`` among them (the
recompile inductor then failed on). A block whose input has other sizes than the block before it still gets
symbolic *activation* sizes (``L['x'].size()[2]``), torch's automatic dynamic shapes for one forward shared by many
modules, as in plain torch with the same graph breaks. One case runs inductor itself, on one rank and two blocks.
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from lightning_fsdp import fully_shard
from tests.conv_nets import BasicBlock, ResNet
from tests.distributed import run_distributed

STEPS = 3
CHANNELS_LAST = torch.channels_last


class RecordingBackend:
    """aot_eager, remembering the sources of each compiled graph's symbolic sizes."""

    def __init__(self) -> None:
        self.symbolic: list[list[str]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        sources = []
        for node in graph.graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("example_value"), torch.SymInt):
                source = getattr(node.meta.get("grapharg"), "source", None)
                sources.append(source.name if source is not None else node.name)
        self.symbolic.append(sources)
        return aot_eager(graph, example_inputs)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(4, 3, 16, 16, generator=data).to(memory_format=CHANNELS_LAST), torch.randint(0, 5, (4,)))
        for _ in range(STEPS)
    ]


def _train(model: nn.Module, run: nn.Module, batches: list, after_first_step: object = None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step, (images, labels) in enumerate(batches):
        loss = F.cross_entropy(run(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 0 and after_first_step is not None:
            after_first_step()
    return losses


def _check_compiled_resnet(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = ResNet().to(memory_format=CHANNELS_LAST)
    batches = _batches(rank)
    eager = fully_shard(copy.deepcopy(plain), {BasicBlock})
    layouts: list[bool] = []
    eager.blocks[1].conv1.register_forward_pre_hook(
        lambda m, _: layouts.append(m.weight.is_contiguous(memory_format=CHANNELS_LAST))
    )
    reference = _train(eager, eager, batches)
    assert layouts and all(layouts), f"a gathered conv weight lost channels_last: {layouts}"

    torch._dynamo.reset()
    backend = RecordingBackend()
    model = fully_shard(copy.deepcopy(plain), {BasicBlock})
    compiled_after_first: list[int] = []
    losses = _train(
        model,
        torch.compile(model, backend=backend),
        batches,
        after_first_step=lambda: compiled_after_first.append(len(backend.symbolic)),
    )
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)
    for (name, param), expected in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert len(backend.symbolic) >= len(model.blocks), f"the blocks were not compiled: {backend.symbolic}"
    assert compiled_after_first == [len(backend.symbolic)], (
        f"{len(backend.symbolic) - compiled_after_first[0]} graphs were compiled after the first step"
    )
    module_state = [s for sources in backend.symbolic for s in sources if "L['self']" in s]
    assert not module_state, f"sizes or ints of the modules were compiled as symbols: {module_state}"


def test_compiled_resnet_blocks_keep_their_modules_static() -> None:
    run_distributed(_check_compiled_resnet, 2, timeout=300.0)


def _check_inductor_trains_a_strided_block(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = ResNet(widths=((8, 1), (12, 2)))  # the second block's stride-2 convolution: where inductor failed
    batches = _batches(rank)[:2]
    eager = fully_shard(copy.deepcopy(plain), {BasicBlock})
    reference = _train(eager, eager, batches)
    torch._dynamo.reset()
    model = fully_shard(copy.deepcopy(plain), {BasicBlock})
    losses = _train(model, torch.compile(model, backend="inductor"), batches)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-5)


def test_inductor_compiles_blocks_of_different_strides() -> None:
    """The issue's failure ("Cannot convert expression to float" in the second block's backward), on one rank: the
    cause, the modules' marking, does not depend on the world size, and inductor's compile is what takes the time."""
    run_distributed(_check_inductor_trains_a_strided_block, 1, timeout=400.0)
