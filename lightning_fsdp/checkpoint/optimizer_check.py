"""Does a checkpoint's optimizer state fit this optimizer? Answered before any state is loaded.

A checkpoint of another optimizer type (SGD's ``momentum_buffer`` into AdamW, which wants ``step``, ``exp_avg`` and
``exp_avg_sq``) or another grouping of the parameters would otherwise fail half-way through the load, after the
model's weights were replaced. The check needs the optimizer's own state keys, which optimizers create lazily at
their first step, so it initialises that state (a zero-learning-rate step, see ``init_optimizer_state``) inside
``optimizers_restored_on_error``: a refusal puts state, hyperparameters and gradients back as they were.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer

from lightning_fsdp.engine.state.state_dict import init_optimizer_state

# Keys a group may carry in one run and not in another without being another optimizer: a scheduler's
# ``initial_lr``, the names this package records for ``convert``.
_OPTIONAL_GROUP_KEYS = {"params", "param_names", "initial_lr"}


@contextmanager
def optimizers_restored_on_error(optimizers: Sequence[Optimizer]) -> Iterator[None]:
    """If the body raises, every optimizer's state, hyperparameters and its parameters' ``.grad`` are as before."""
    snapshots = [
        (
            dict(optimizer.state),
            [dict(group) for group in optimizer.param_groups],
            [(param, param.grad) for group in optimizer.param_groups for param in group["params"]],
        )
        for optimizer in optimizers
    ]
    try:
        yield
    except BaseException:
        for optimizer, (state, groups, grads) in zip(optimizers, snapshots, strict=True):
            optimizer.state.clear()
            optimizer.state.update(state)
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.clear()
                group.update(saved)
            for param, grad in grads:
                param.grad = grad
        raise


def check_optimizer_fits(
    optimizer: Optimizer,
    saved_groups: Sequence[Mapping[str, Any]],
    saved_state_keys: Mapping[int, set[str]],
    names: Sequence[str],
    source: object,
) -> None:
    """Refuse a checkpoint whose optimizer differs from ``optimizer`` in grouping, type or state keys.

    ``saved_groups`` are the checkpoint's parameter groups (hyperparameters, and ``params`` of the right length);
    ``saved_state_keys`` the state keys it recorded per position in the flattened parameter list, whose names
    ``names`` gives. Initialises ``optimizer``'s state: call it inside ``optimizers_restored_on_error``.
    """
    kind = type(optimizer).__name__
    current = [len(group["params"]) for group in optimizer.param_groups]
    found = [len(group["params"]) for group in saved_groups]
    if current != found:
        raise ValueError(
            f"the checkpoint at {source} has optimizer parameter groups of sizes {found} but this {kind} has "
            f"{current}; resume with the configure_optimizers the checkpoint was trained with."
        )
    for number, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        foreign = sorted(set(saved) - set(group) - _OPTIONAL_GROUP_KEYS)
        if foreign:
            raise ValueError(
                f"the checkpoint at {source} has optimizer hyperparameters {foreign} in group {number} that this "
                f"{kind} does not have: it was saved by another optimizer type; resume with the optimizer the "
                "checkpoint was trained with."
            )
    init_optimizer_state(optimizer)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params):
        saved = saved_state_keys.get(index)
        own = set(optimizer.state.get(param, {}))
        if saved and own and saved != own:
            raise ValueError(
                f"the checkpoint at {source} has optimizer state {sorted(saved)} for '{names[index]}' but this {kind} "
                f"keeps {sorted(own)}: it was saved by another optimizer type or configuration; resume with the "
                "optimizer the checkpoint was trained with."
            )
