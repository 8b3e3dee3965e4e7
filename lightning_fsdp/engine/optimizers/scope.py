"""What an optimizer reads to update a parameter: each element on its own, the whole tensor, or other tensors too.

A rank steps only the parameters it holds, so the engine must know what an optimizer's step reads. A scope declared with
``declare_update_scope``, or that of a known torch optimizer (``KNOWN_SCOPES``), answers at once; any other optimizer is
asked by experiment (``probe_scope``): see [Note: asking the optimizer what it reads], above it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

import torch
from torch.optim import Optimizer


class UpdateScope(Enum):
    """What an optimizer's update of one parameter reads (see [Note: asking the optimizer what it reads])."""

    ELEMENTWISE = "elementwise"  # each element's own value, gradient and state: rows on each rank are exact
    TENSOR = "tensor"  # the whole tensor: it must live whole on one rank
    ACROSS_TENSORS = "across_tensors"  # other parameters too: no rank can compute it from what it holds


_E, _T, _A = UpdateScope.ELEMENTWISE, UpdateScope.TENSOR, UpdateScope.ACROSS_TENSORS
# The torch optimizers whose answer is known skip the probe; a test keeps this table equal to the probe's answers.
KNOWN_SCOPES: dict[type[Optimizer], UpdateScope] = {
    torch.optim.SGD: _E,
    torch.optim.Adam: _E,
    torch.optim.AdamW: _E,
    torch.optim.Adamax: _E,
    torch.optim.NAdam: _E,
    torch.optim.RAdam: _E,
    torch.optim.Adagrad: _E,
    torch.optim.Adadelta: _E,
    torch.optim.RMSprop: _E,
    torch.optim.Rprop: _E,
    torch.optim.ASGD: _E,
    torch.optim.Adafactor: _T,
    torch.optim.LBFGS: _A,
}
if hasattr(torch.optim, "Muon"):  # torch 2.9 and later
    KNOWN_SCOPES[torch.optim.Muon] = _T

_DECLARED: WeakKeyDictionary[type, UpdateScope] = WeakKeyDictionary()

# Tensors of up to this many elements are probed at their own shape, so size thresholds inside an optimizer
# (bitsandbytes' 4096-element switch to 8-bit states) are met as training meets them; larger ones at a shape scaled
# down to about that many elements (``probe_shape``).
PROBE_MAX_NUMEL = 1 << 18
PROBE_STEPS = 3
PROBE_LR = 1e-2  # the probe's learning rate where the group's is zero


class ProbeFailedError(RuntimeError):
    """The probe of an optimizer could not step (see [Note: asking the optimizer what it reads])."""


def declare_update_scope(optimizer_class: type[Optimizer], scope: str | UpdateScope) -> None:
    """Say what ``optimizer_class``'s step reads to update a parameter, instead of letting the engine probe it:
    ``"elementwise"`` (each element on its own), ``"tensor"`` (the whole tensor: each lives whole on one rank) or
    ``"across_tensors"`` (other parameters too: refused on sharded parameters). Exactly the class, not subclasses."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(f"declare_update_scope takes an optimizer class, not {optimizer_class!r}.")
    try:
        _DECLARED[optimizer_class] = UpdateScope(scope)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in UpdateScope)
        raise ValueError(f"declare_update_scope: scope {scope!r} is not one of {choices}.") from None


def declared_scope(optimizer: Optimizer) -> UpdateScope | None:
    """The scope the user declared for the optimizer's class, or the table's; None: ask the optimizer."""
    kind = type(optimizer)
    return _DECLARED.get(kind) or KNOWN_SCOPES.get(kind)


def probe_shape(shape: torch.Size) -> tuple[int, ...]:
    """A shape of at most about ``PROBE_MAX_NUMEL`` elements with the same dimensions, rows and proportions; a 0-dim
    parameter as one element."""
    dims = tuple(shape) or (1,)
    numel = math.prod(dims)
    if numel <= PROBE_MAX_NUMEL:
        return dims
    scale = (PROBE_MAX_NUMEL / numel) ** (1 / len(dims))
    return tuple(max(2, math.ceil(d * scale)) if d > 1 else d for d in dims)


# [Note: asking the optimizer what it reads] A rank steps only the parameters it holds, so the engine must know, for
# each parameter an optimizer steps, what that step reads. The class cannot tell us (a third-party optimizer is not on
# any list, and a subclass may change its step), so the optimizer is asked by experiment: a *probe*, a copy of it with
# the same class, attributes and hyperparameters but fresh state and tensors of its own (the real optimizer, its
# parameters and its state are never touched), takes a few steps on a small tensor shaped like the parameter, three ways
# -- whole; split in two by rows, as ranks would hold it; and beside another tensor. An update that differs beside
# another tensor reads other tensors (``ACROSS_TENSORS``); one that differs split in two, or that keeps state not shaped
# like its parameter (row and column statistics, preconditioners, quantization blocks and their maps), reads the whole
# tensor (``TENSOR``); only an update that is the same to the bit either way is ``ELEMENTWISE``. The rows of the probe
# differ in magnitude by orders, so a statistic over rows cannot agree by chance. ``declare_update_scope`` lets a user
# answer for a class whose probe cannot run (a step that needs more than a closure, say).
def probe_scope(optimizer: Optimizer, group_index: int, shape: tuple[int, ...], like: torch.Tensor) -> UpdateScope:
    """Ask ``optimizer`` (by its probe) what its group ``group_index`` reads to update a tensor of ``shape`` in the
    dtype and on the device of ``like``. Raises ``ProbeFailedError`` when the probe cannot step."""
    generator = torch.Generator().manual_seed(0)
    rows = shape[0]
    row_scale = torch.logspace(-2, 1, rows).reshape(rows, *[1] * (len(shape) - 1))

    def draw(size: tuple[int, ...], scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        values = torch.randn(size, generator=generator) * scale
        return values.to(dtype=like.dtype, device=like.device)

    start = draw(shape, row_scale)
    grads = [draw(shape, row_scale.flip(0) * (step + 1)) for step in range(PROBE_STEPS)]
    other_shape = (rows + 3, *[d + 2 for d in shape[1:]])
    other = draw(other_shape)
    other_grads = [draw(other_shape) for _ in range(PROBE_STEPS)]

    whole = _run(optimizer, group_index, [start], [[g] for g in grads])
    if torch.equal(whole.values[0], start):
        raise ProbeFailedError("its step did not change the test tensor")
    beside = _run(optimizer, group_index, [start, other], [[g, o] for g, o in zip(grads, other_grads, strict=True)])
    if not (
        _same(whole.values[0] - start, beside.values[0] - start)
        and _same_values(whole.state, beside.state)
        and _same_values(whole.group, beside.group)
    ):
        return UpdateScope.ACROSS_TENSORS
    if any(_not_per_element(t, shape) for t in _tensors_in(whole.state)):
        return UpdateScope.TENSOR
    if rows > 1:
        half = rows // 2
        split = _run(optimizer, group_index, [start[:half], start[half:]], [[g[:half], g[half:]] for g in grads])
        if not _same(whole.values[0] - start, torch.cat(split.values) - start):
            return UpdateScope.TENSOR
    return UpdateScope.ELEMENTWISE


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal but for the last bits of float arithmetic: what two element-wise updates of the same numbers are (to the
    bit, in practice); a statistic over other elements or tensors moves them far more."""
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    scale = max(a.abs().max().item() if a.numel() else 0.0, 1e-30)
    return bool(torch.isfinite(a).all()) and torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


def _not_per_element(state: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """A state tensor that is not one number per element of its parameter: of another shape (row statistics, a
    preconditioner), or a tensor subclass (quantized in blocks, as torchao's low-bit states are)."""
    plain = type(state) in (torch.Tensor, torch.nn.Parameter)
    return not plain or (state.numel() > 1 and tuple(state.shape) != shape)


def _same_values(a: Any, b: Any) -> bool:
    """Two snapshots of optimizer state or of a parameter group (nested containers, tensors, numbers) hold the same
    statistics: floats and tensors alike. Tensor subclasses (quantized states) are compared by type and shape only, and
    integers not at all (a count of the group's elements): the values' deltas judge those."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if type(a) not in (torch.Tensor, torch.nn.Parameter) or type(b) is not type(a):
            return type(a) is type(b) and a.shape == b.shape
        return a.numel() == 0 or _same(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_values(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b)  # counts and flags (how many tensors a group has, say) are no statistic


def _tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors in a state value, looking into containers and objects (a preconditioner object's matrices)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, list | tuple):
        children = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        children = list(vars(value).values())
    else:
        return []
    return [tensor for child in children for tensor in _tensors_in(child, depth - 1)]


class _Probed(NamedTuple):
    values: list[torch.Tensor]  # the tensors after the steps
    state: dict[str, Any]  # the state of the first tensor
    group: dict[str, Any]  # the group's entries but its tensors


def _run(optimizer: Optimizer, group_index: int, start: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> _Probed:
    """Step a probe of ``optimizer`` on copies of ``start`` with ``grads`` (one list per step)."""
    params = [torch.nn.Parameter(t.clone()) for t in start]
    probe = _probe_of(optimizer, group_index, params)
    step = type(probe).step
    step = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step  # no hooks of anyone's
    takes_closure = _takes_closure(step)
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()

        def closure(step_grads: list[torch.Tensor] = step_grads) -> torch.Tensor:
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad.clone()
            return sum((p.detach() * g).sum() for p, g in zip(params, step_grads, strict=True))

        try:
            with _eagerly():
                step(probe, closure) if takes_closure else step(probe)
        except Exception as error:  # noqa: BLE001 -- any failure of a foreign step is reported the same way
            raise ProbeFailedError(f"{type(error).__name__}: {error}") from error
    group = {key: value for key, value in probe.param_groups[0].items() if key != "params"}
    return _Probed([p.detach() for p in params], dict(probe.state.get(params[0], {})), group)


def _eagerly() -> contextlib.AbstractContextManager:
    """No compilation inside the probe: a compiled step (heavyball's) would compile again for every test tensor."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch 2.6 and later
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _takes_closure(step: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(step).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in parameters)


def _probe_of(optimizer: Optimizer, group_index: int, params: list[torch.nn.Parameter]) -> Optimizer:
    """A copy of ``optimizer`` that steps ``params`` alone, with the hyperparameters of its group ``group_index``:
    every attribute deep-copied except the parameters (a placeholder stands for each), the state (empty) and the
    hooks (none), so nothing the probe does reaches the real optimizer."""
    placeholder = torch.empty(0)
    memo: dict[int, Any] = {id(p): placeholder for group in optimizer.param_groups for p in group["params"]}
    probe = _copy_optimizer(optimizer, memo)
    groups = probe.param_groups
    group = {**groups[group_index], "params": params}
    if _is_zero(group.get("lr")):  # a warm-up's first step, or a zero-lr step to create state: nothing would move
        initial = group.get("initial_lr")  # where a scheduler recorded the rate it starts from
        group["lr"] = initial if initial is not None and not _is_zero(initial) else PROBE_LR
    groups[:] = [group]  # in place: an optimizer wrapping another shares its list of groups
    return probe


def _is_zero(lr: Any) -> bool:
    return isinstance(lr, int | float | torch.Tensor) and float(lr) == 0.0


def _copy_optimizer(optimizer: Optimizer, memo: dict[int, Any]) -> Optimizer:
    probe = object.__new__(type(optimizer))
    memo[id(optimizer)] = probe
    for key, value in vars(optimizer).items():
        if key == "state":
            value = defaultdict(dict)
        elif key.startswith("_optimizer_") and key.endswith("_hooks"):
            value = OrderedDict()
        elif key == "step":  # a scheduler's wrapper of the real optimizer's bound step
            continue
        elif isinstance(value, Optimizer):
            value = memo[id(value)] if id(value) in memo else _copy_optimizer(value, memo)
        else:
            value = copy.deepcopy(value, memo)
        probe.__dict__[key] = value
    return probe
