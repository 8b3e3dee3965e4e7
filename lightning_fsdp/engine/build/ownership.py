"""Which unit owns which parameter.

A parameter belongs to the deepest unit whose module contains every module that registers it. Usually that is the
unit of the one module that uses it; a parameter shared across units -- GPT's token embedding tied to its output
head, with the head and the embedding in different units -- goes to their common ancestor unit (the root at the
latest), which is unsharded before and resharded after both users run, in forward and in backward. We keep it
there rather than refusing: it costs that ancestor the parameter's memory for the span of its forward, which is
what the unsharded model would pay anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn


@dataclass
class OwnedParam:
    param: nn.Parameter
    fqn: str  # the first name it is reachable under, as in ``named_parameters()``
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def assign_params(
    root: nn.Module, is_unit_module: Callable[[nn.Module], bool], skip: Callable[[nn.Parameter], bool]
) -> dict[nn.Module, list[OwnedParam]]:
    """Map every unit module under ``root`` (root included) to the parameters it owns, in ``named_parameters`` order.

    ``skip`` excludes parameters the engine must not take (already sharded by an earlier call, or ignored).
    """
    found: dict[int, OwnedParam] = {}
    chains: dict[int, list[tuple[nn.Module, ...]]] = {}

    def walk(module: nn.Module, prefix: str, chain: tuple[nn.Module, ...], path: frozenset[int]) -> None:
        if id(module) in path:  # a module reachable from itself; nothing new below
            return
        path = path | {id(module)}
        if module is root or is_unit_module(module):
            chain = (*chain, module)
        for name, param in module._parameters.items():
            if param is None or skip(param):
                continue
            owned = found.setdefault(id(param), OwnedParam(param, prefix + name))
            if not any(m is module and n == name for m, n in owned.owners):
                owned.owners.append((module, name))
                chains.setdefault(id(param), []).append(chain)
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{child_name}.", chain, path)

    walk(root, "", (), frozenset())
    assignment: dict[nn.Module, list[OwnedParam]] = {}
    for key, owned in found.items():
        assignment.setdefault(_deepest_common(chains[key]), []).append(owned)
    return assignment


def _deepest_common(chains: list[tuple[nn.Module, ...]]) -> nn.Module:
    common = chains[0]
    for chain in chains[1:]:
        depth = 0
        while depth < min(len(common), len(chain)) and common[depth] is chain[depth]:
            depth += 1
        common = common[:depth]
    return common[-1]
