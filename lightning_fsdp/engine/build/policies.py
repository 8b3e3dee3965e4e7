"""Auto-wrap policies: which modules become sharding units, decided bottom-up.

A policy is a set of module classes, or a callable ``policy(module, recurse, nonwrapped_numel) -> bool`` -- the
protocol torch's own auto-wrap policies follow, so ``functools.partial(torch.distributed.fsdp.wrap.
size_based_auto_wrap_policy, min_num_params=...)`` works unchanged. Asked with ``recurse=True`` the callable says
whether to look inside ``module``; with ``recurse=False``, whether ``module`` itself becomes a unit, given the
number of parameters in its subtree that no descendant unit took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

WrapPolicy = Callable[[nn.Module, bool, int], bool]
PolicyLike = WrapPolicy | Iterable[type[nn.Module]] | None


class ModuleClassPolicy:
    """Wrap every module that is an instance of one of ``classes`` (a transformer's block, say)."""

    def __init__(self, classes: Iterable[type[nn.Module]]) -> None:
        self.classes = tuple(sorted(module_classes(list(classes)) or (), key=lambda cls: cls.__qualname__))

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.classes)

    def __repr__(self) -> str:
        return "{" + ", ".join(c.__name__ for c in self.classes) + "}"


class SizeBasedPolicy:
    """Wrap a module once the parameters in its subtree that no descendant unit took reach ``min_num_params``.

    Containers (``ModuleList``, ``ModuleDict``) are never wrapped: they have no forward of their own, so a unit on
    them would never be gathered.
    """

    def __init__(self, min_num_params: int = 100_000_000) -> None:
        self.min_num_params = int(min_num_params)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        return nonwrapped_numel >= self.min_num_params and not isinstance(module, nn.ModuleList | nn.ModuleDict)

    def __repr__(self) -> str:
        return f"SizeBasedPolicy(min_num_params={self.min_num_params})"


def size_based_policy(min_num_params: int = 100_000_000) -> SizeBasedPolicy:
    return SizeBasedPolicy(min_num_params)


def module_classes(policy: object, argument: str = "policy") -> set[type[nn.Module]] | None:
    """The classes of a policy given as classes (one, or an iterable of them); None for a callable or None.

    The one validation of the class forms, shared by ``fully_shard``, ``apply_activation_checkpointing`` and the
    Lightning strategy (which first imports the class paths a config names): a bad value gets the same exception
    and sentence from every entry point, naming the ``argument`` it was given as.
    """
    if isinstance(policy, nn.Module):
        raise ValueError(f"{argument} holds a {type(policy).__name__} instance; pass its class (or import path).")
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return None
    items = [policy] if isinstance(policy, type) else policy
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise ValueError(
            f"{argument}={policy!r} is not a policy; pass a set of module classes (or their import paths), a callable "
            "(module, recurse, nonwrapped_numel) -> bool, or None."
        )
    classes = set(items)
    if not classes:
        raise ValueError(f"{argument} is an empty set; name the model's repeated blocks, or pass None.")
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{argument} holds {cls!r}, which is not an nn.Module class; list module classes only.")
    return classes


def as_wrap_policy(policy: PolicyLike, argument: str = "policy") -> WrapPolicy | None:
    """The policy as a callable (see ``module_classes`` for the forms and their validation)."""
    classes = module_classes(policy, argument)
    if classes is None:
        return policy  # type: ignore[return-value]
    return ModuleClassPolicy(classes)


def select_unit_modules(
    root: nn.Module,
    policy: WrapPolicy,
    is_unit: Callable[[nn.Module], bool],
    is_ignored: Callable[[nn.Module], bool],
) -> list[nn.Module]:
    """The modules below ``root`` that the policy makes units, children before parents (root excluded).

    Modules that already are units (an earlier ``fully_shard`` call) stay units and count as wrapped; ignored
    modules are neither wrapped nor looked into.
    """
    selected: list[nn.Module] = []
    seen_params: set[int] = set()

    def subtree_numel(module: nn.Module) -> int:
        total = 0
        for param in module.parameters():
            if id(param) not in seen_params:
                total += param.numel()
        return total

    def visit(module: nn.Module) -> int:
        """Returns the number of parameters in ``module``'s subtree that units took."""
        if is_ignored(module):
            return 0
        if is_unit(module):
            taken = subtree_numel(module)
            seen_params.update(id(p) for p in module.parameters())
            return taken
        nonwrapped = subtree_numel(module)
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
            return 0
        taken = sum(visit(child) for child in module.children())
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - taken):
            selected.append(module)
            seen_params.update(id(p) for p in module.parameters())
            return nonwrapped
        return taken

    visit(root)
    return selected


def repeated_block_class(root: nn.Module, min_share: float = 0.5) -> type[nn.Module] | None:
    """The class of ``root``'s repeated blocks, the natural sharding units, or None when it has none worth it.

    First choice: the class of the children of the container (``nn.ModuleList`` or ``nn.Sequential``) whose children
    with parameters all share one class and hold the most parameters (a transformer's ``blocks``). Otherwise the
    non-leaf class with the most instances (two or more). Either way the instances must hold at least ``min_share``
    of the model's parameters: sharding a small part unit by unit saves little and costs collectives.
    """
    total = sum(p.numel() for p in root.parameters())
    if total == 0:
        return None

    def numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    best: tuple[int, type[nn.Module]] | None = None
    for container in root.modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        blocks = [child for child in container.children() if numel(child) > 0]
        classes = {type(child) for child in blocks}
        if len(blocks) >= 2 and len(classes) == 1:
            size = sum(numel(child) for child in blocks)
            if best is None or size > best[0]:
                best = (size, classes.pop())
    if best is None:
        counts: dict[type[nn.Module], list[nn.Module]] = {}
        for module in root.modules():
            if module is not root and any(True for _ in module.children()) and numel(module) > 0:
                if not isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential):
                    counts.setdefault(type(module), []).append(module)
        repeated = [(len(ms), sum(map(numel, ms)), cls) for cls, ms in counts.items() if len(ms) >= 2]
        if repeated:
            _, size, cls = max(repeated, key=lambda item: (item[0], item[1]))
            best = (size, cls)
    if best is None or best[0] < min_share * total:
        return None
    return best[1]
