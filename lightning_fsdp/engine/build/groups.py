"""The process groups one ``fully_shard`` call uses: where rows are spread, and where gradients are also summed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fsdp.engine.options import ShardingStrategy


@dataclass(frozen=True)
class Groups:
    """``shard``: the ranks one parameter's rows are spread over (None: every rank holds all rows).
    ``replicate``: the ranks whose gradients are summed after the shard reduction (None: none).
    ``sync``: every rank of the model, for ``sync_module_states``."""

    shard: ProcessGroup | None
    replicate: ProcessGroup | None
    sync: ProcessGroup

    def as_pair(self) -> tuple[ProcessGroup | None, ProcessGroup | None]:
        return self.shard, self.replicate


def resolve_groups(
    strategy: ShardingStrategy, process_group: ProcessGroup | None, device_mesh: DeviceMesh | tuple[int, int] | None
) -> Groups:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized: call torch.distributed.init_process_group() "
            "first, or launch the script with torchrun."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if strategy.is_hybrid:
        mesh = _hybrid_mesh(device_mesh, group)
        return Groups(shard=mesh.get_group(1), replicate=mesh.get_group(0), sync=group)
    if device_mesh is not None:
        raise ValueError(f"device_mesh is only used by HYBRID_SHARD, not {strategy.value}; drop it or switch strategy.")
    if strategy is ShardingStrategy.NO_SHARD:
        return Groups(shard=None, replicate=group, sync=group)
    return Groups(shard=group, replicate=None, sync=group)


def _hybrid_mesh(device_mesh: DeviceMesh | tuple[int, int] | None, group: ProcessGroup) -> DeviceMesh:
    world_size = group.size()
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim != 2:
            raise ValueError(f"HYBRID_SHARD needs a 2-D (replicate, shard) device mesh, got {device_mesh.ndim}-D.")
        return device_mesh
    if device_mesh is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        if not local or world_size % local:
            raise ValueError(
                "HYBRID_SHARD needs device_mesh=(replicate, shard), e.g. (num_nodes, devices_per_node); "
                "LOCAL_WORLD_SIZE is not set to a divisor of the world size to infer it from."
            )
        device_mesh = (world_size // local, local)
    sizes = tuple(device_mesh)
    if len(sizes) != 2 or sizes[0] * sizes[1] != world_size:
        raise ValueError(
            f"device_mesh={sizes} does not match the world size {world_size}: pass (replicate, shard) sizes whose "
            f"product is {world_size}."
        )
    device_type = "cuda" if dist.get_backend(group) == dist.Backend.NCCL else "cpu"
    key = (group.group_name, sizes, device_type)
    mesh = _MADE.get(key)
    if mesh is None or not all(_registered(mesh.get_group(dim)) for dim in range(mesh.ndim)):
        mesh = _MADE[key] = init_device_mesh(device_type, sizes, mesh_dim_names=("replicate", "shard"))
    return mesh


# The meshes made here, by the parent group's name, the sizes and the device type: the models of a sweep over the
# same ranks share one set of groups, where a mesh per ``fully_shard`` call would add a group per fit, each with its
# sockets and gloo's threads, for the rest of the process. A mesh whose groups were destroyed since (the process
# group torn down and made again) is made anew, on every rank alike.
_MADE: dict[tuple[str, tuple[int, ...], str], DeviceMesh] = {}


def _registered(group: ProcessGroup) -> bool:
    """Whether ``group`` is still one of torch.distributed's (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True
