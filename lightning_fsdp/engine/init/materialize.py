"""Deferred initialisation: materialise a model built on the meta device module by module, in module order.

Each module with parameters or buffers of its own on the meta device gets real tensors on the target device, which are
then initialised in one of two ways: a model built under :func:`track_meta_build` (the strategies' empty init) gets the
init program its ``__init__`` ran replayed (``_materialize_by_replay``; see [Note: replaying the eager build's init] in
``program.py``), any other each module's ``param_init_fn(module)`` or ``reset_parameters()``
(``_materialize_by_initialisers``). Whenever a unit's last parameter is ready the caller shards it, so the full tensors
alive at any moment are one unit's plus whatever its ancestors have materialised so far -- not the whole model.

Every tensor starts out filled with a mark no initialiser writes and is checked after:
see [Note: tensors no initialiser wrote]. Tied parameters: ``_tied_stand_ins``. Modules built under
:func:`track_meta_build` refuse a ``load_state_dict`` that would be a silent no-op (``_refuse_load_into_meta``).
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from lightning_fsdp.engine.init.program import InitProgram, covers_storage, recording, storage_key

ParamInitFn = Callable[[nn.Module], None]
log = logging.getLogger(__name__)

# meta parameter -> its creator module, both weakly (by identity: tensors compare elementwise); see track_meta_build.
_CREATORS = WeakIdKeyDictionary()
_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Each module that registered a meta tensor under track_meta_build -> the init program recorded there.
_PROGRAM_OF: weakref.WeakKeyDictionary[nn.Module, InitProgram] = weakref.WeakKeyDictionary()


@contextmanager
def meta_build() -> Generator[None, None, None]:
    """Build a model for ``fully_shard`` on the meta device, recorded: ``fully_shard`` then gives it the values the
    eager build would have (the same draws, in the same order), where a plain ``torch.device("meta")`` falls back to
    each module's ``reset_parameters()``. The engine's equivalent of the Trainer's ``empty_init=True`` and Fabric's
    ``init_module(empty_init=True)``; seed before the block as for the eager build."""
    with torch.device("meta"), track_meta_build():
        yield


@contextmanager
def track_meta_build() -> Generator[None, None, None]:
    """While a model is built on the meta device: record the init program the eager build would run (see [Note:
    replaying the eager build's init] in ``program.py``), remember which module created each parameter, and
    make every module holding meta parameters refuse a ``load_state_dict`` that would be a silent no-op."""
    program = InitProgram()

    def on_register_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None and buffer.is_meta:
            _PROGRAM_OF[module] = program

    def on_register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or not param.is_meta:
            return
        _PROGRAM_OF[module] = program
        if _creator(param) is None:
            _CREATORS[param] = weakref.ref(module)
        if module not in _GUARDED:
            _GUARDED.add(module)
            module.register_load_state_dict_pre_hook(_refuse_load_into_meta)

    handles = [
        register_module_parameter_registration_hook(on_register),
        register_module_buffer_registration_hook(on_register_buffer),
    ]
    try:
        with recording(program):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _refuse_load_into_meta(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *_: Any
) -> None:
    """Loading a state dict into meta parameters would silently do nothing (copying into a tensor without storage), so
    modules built under :func:`track_meta_build` refuse it with the fix, unless ``assign=True`` replaces them."""
    if local_metadata.get("assign_to_params_buffers", False):
        return
    meta = [
        name for name, p in module._parameters.items() if p is not None and p.is_meta and prefix + name in state_dict
    ]
    if meta:
        raise RuntimeError(
            f"load_state_dict into {type(module).__name__}.{meta[0]} would do nothing: the module was built on the "
            "meta device (empty init), where parameters have no storage; load the weights after sharding (a "
            "checkpoint through the Trainer), build the model without empty init, or pass assign=True."
        )


def _creator(param: nn.Parameter) -> nn.Module | None:
    creator = _CREATORS.get(param)
    return creator() if creator is not None else None


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _own_meta(module: nn.Module) -> tuple[list[str], list[str]]:
    params = [name for name, p in module._parameters.items() if p is not None and p.is_meta]
    buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    return params, buffers


def check_initializable(root: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    """Refuse, before anything is materialised, a meta module that nothing knows how to initialise, or whose
    initialiser leaves a buffer computed at ``__init__`` unset (see [Note: tensors no initialiser wrote])."""
    program, _ = _replay_plan(root, param_init_fn)
    if program is not None:
        _check_replay_writes_computed_buffers(root, program)
        return
    for name, module in root.named_modules():
        label = f"module '{name or type(root).__name__}' ({type(module).__name__})"
        params, buffers = _own_meta(module)
        if param_init_fn is None and (params or buffers) and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"{label} was built on the meta device but has no reset_parameters() to initialise its own tensors; "
                "give fully_shard a param_init_fn(module) that initialises it, or build that module on a real device."
            )
        computed = [b for b in buffers if b in module._non_persistent_buffers_set]
        if computed and (unset := _left_unwritten_by_initialiser(module, computed, param_init_fn)):
            initialiser = "param_init_fn" if param_init_fn is not None else "its reset_parameters()"
            raise ValueError(
                f"{label} was built on the meta device, where the value its __init__ computed for the "
                f"non-persistent buffer(s) {', '.join(unset)} was lost, and {initialiser} does not set it; compute "
                "it there too, or build that module on a real device. Nothing was materialised."
            )


def _left_unwritten_by_initialiser(module: nn.Module, names: list[str], param_init_fn: ParamInitFn | None) -> list[str]:
    """Which of ``module``'s own buffers ``names`` its initialiser leaves unwritten, tried on a scratch copy."""
    try:
        scratch = copy.deepcopy(module)  # children stay on the meta device: initialising them there does nothing
    except Exception:  # noqa: BLE001 - a module that cannot be copied is checked after materialising instead
        return []
    params, buffers = _own_meta(scratch)
    for name in buffers:
        scratch._buffers[name] = _marked_empty(scratch._buffers[name], torch.device("cpu"))
    for name in params:
        meta = scratch._parameters[name]
        scratch._parameters[name] = nn.Parameter(_marked_empty(meta, torch.device("cpu")), meta.requires_grad)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the real build draws the same numbers after
        try:
            _initialise(scratch, param_init_fn)
        except Exception:  # noqa: BLE001 - e.g. it reads a child's values, still on the meta device in the copy:
            return []  # the real initialisation judges it, after materialising (the warning)
    return [name for name in names if _unwritten(scratch._buffers[name])]


def _initialise(module: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    if param_init_fn is not None:
        param_init_fn(module)
    else:
        module.reset_parameters()


# [Note: tensors no initialiser wrote] Materialising a meta tensor gives it memory holding whatever was there. A
# module's initialiser must write every tensor of its own, and one it forgets would train from garbage that looks like
# numbers -- most often a buffer its ``__init__`` computes (a rotary embedding's inverse frequencies, a causal mask),
# which a meta build computes on the meta device and so loses. Every tensor is therefore materialised filled with a
# value no initialiser writes (NaN; integers: their largest value; booleans: the byte 255) and checked after its
# initialiser ran. A non-persistent buffer left so is refused before anything is materialised, since no state dict will
# ever fill it: the initialiser of each module holding one is first run on a scratch copy of it (the random stream
# restored after); replayed, one that no recorded op writes is refused. A parameter or persistent buffer left so is
# named in one warning, since a checkpoint loaded after setup may be meant to fill it; until then it holds NaN, so a
# forgotten one fails at the first loss instead of training. A non-persistent buffer the trial could not judge (its
# module cannot be copied, or its initialiser fails on the copy) and the real initialiser left unset is named in a
# warning of its own: no checkpoint will fill it.
def _marked_empty(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor shaped like ``like`` on ``device``, filled with what no initialiser writes (see [Note: tensors no
    initialiser wrote]): NaN; an integer's largest value; for booleans the byte 255, which no boolean op writes.
    Dtypes with no such value (quantized ones) are left as allocated."""
    tensor = torch.empty_like(like, device=device)
    if tensor.dtype == torch.bool:
        tensor.view(torch.uint8).fill_(255)
    elif tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif (mark := _integer_mark(tensor.dtype)) is not None:
        tensor.fill_(mark)
    return tensor


def _integer_mark(dtype: torch.dtype) -> int | None:
    try:
        return torch.iinfo(dtype).max
    except TypeError:  # quantized and other dtypes without integer arithmetic
        return None


def _unwritten(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (made by ``_marked_empty``) still holds only its mark."""
    if tensor.numel() == 0:
        return False
    if tensor.dtype == torch.bool:
        return bool((tensor.view(torch.uint8) == 255).all())
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).all())
    mark = _integer_mark(tensor.dtype)
    return mark is not None and bool((tensor == mark).all())


def materialize(
    root: nn.Module,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    owners_of: dict[int, list[tuple[nn.Module, str]]],
    on_param_ready: Callable[[nn.Parameter, nn.Parameter], None],
) -> None:
    """Materialise and initialise every meta tensor under ``root``; report each parameter as (meta, real).

    A model built under :func:`track_meta_build` gets its recorded init program replayed (the eager build's
    values, see [Note: replaying the eager build's init]); with a ``param_init_fn``, or where the program cannot be
    replayed (the reason is logged), each module's initialiser runs instead, in module order."""
    program, reason = _replay_plan(root, param_init_fn)
    if program is not None:
        unset, lost = _materialize_by_replay(root, device, program, owners_of, on_param_ready)
    else:
        if reason is not None:
            log.log(
                logging.INFO if reason.endswith(_EXPECTED_FALLBACKS) else logging.WARNING,
                "lightning_fsdp: the meta build's init cannot be replayed (%s); each module's reset_parameters() "
                "initialises it instead, which gives the eager build's values only when every module initialises "
                "its own tensors there, in the order module order visits them",
                reason,
            )
        unset, lost = _materialize_by_initialisers(root, device, param_init_fn, owners_of, on_param_ready)
    if unset:
        warnings.warn(
            f"{len(unset)} tensor(s) materialised from the meta device were written by neither reset_parameters() "
            f"nor param_init_fn: {_listed(unset)}. They hold NaN (integers: their largest value) until a checkpoint "
            "is loaded into them; initialise them there if none will be.",
            stacklevel=3,
        )
    if lost:
        warnings.warn(
            f"{len(lost)} non-persistent buffer(s) materialised from the meta device were written by neither "
            f"reset_parameters() nor param_init_fn: {_listed(lost)}. No checkpoint holds them, so they keep NaN "
            "(integers: their largest value) and training will fail; compute them in the initialiser, or build "
            "those modules on a real device.",
            stacklevel=3,
        )


_NOT_RECORDED = "was put on the meta device outside track_meta_build, so no init was recorded"
_RESET_REPLACED = "had its reset_parameters replaced on the instance: that is what initialises it"
# Fallbacks that are what the user set up (logged at INFO); any other is a build the replay could not express.
_EXPECTED_FALLBACKS = (_NOT_RECORDED, _RESET_REPLACED)


def _replay_plan(root: nn.Module, param_init_fn: ParamInitFn | None) -> tuple[InitProgram | None, str | None]:
    """The recorded program that initialises every meta tensor under ``root``, or why none can (no reason when the
    caller gave its own initialiser or nothing is on the meta device)."""
    if param_init_fn is not None:
        return None, None
    programs: dict[int, InitProgram] = {}
    tensors: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (its name, it): a tied one once
    for path, module in root.named_modules():
        params, buffers = _own_meta(module)
        reason = _initialised_outside_the_build(path or type(root).__name__, module, bool(params or buffers))
        if reason is not None:
            return None, reason
        if not params and not buffers:
            continue
        program = _PROGRAM_OF.get(module)
        if program is None:
            label = path or type(root).__name__
            return None, f"module '{label}' {_NOT_RECORDED}"
        programs[id(program)] = program
        for name in params:
            tensors.setdefault(id(module._parameters[name]), (_joined(path, name), module._parameters[name]))
        for name in buffers:
            tensors.setdefault(id(module._buffers[name]), (_joined(path, name), module._buffers[name]))
    if not programs:
        return None, None
    if len(programs) > 1:
        return None, "parts of the model were built on the meta device in different builds"
    program = next(iter(programs.values()))
    if program.unsupported is not None:
        return None, program.unsupported
    names_by_key: dict[int, str] = {}
    for name, tensor in tensors.values():
        key = storage_key(tensor)
        if key not in program.storages:
            return None, f"{name} was created outside the recorded build"
        if key in names_by_key:
            return None, f"{name} shares memory with {names_by_key[key]}"
        if not covers_storage(tensor):
            return None, f"{name} is a view of a larger tensor"
        names_by_key[key] = name
    return program, None


def _initialised_outside_the_build(name: str, module: nn.Module, holds_meta: bool) -> str | None:
    """Why ``module``'s initialisation is not in what its build ran, where a known convention says so."""
    if holds_meta and "reset_parameters" in vars(module):
        # LitGPT's pretrain initialize_weights sets each module's reset_parameters after the meta build, for the
        # FSDP convention (materialising calls it) to run: the eager script calls them all after building.
        return f"module '{name}' {_RESET_REPLACED}"
    if callable(getattr(type(module), "_init_weights", None)) and callable(getattr(type(module), "post_init", None)):
        # transformers' PreTrainedModel.init_weights skips _init_weights when built under torch.device("meta").
        return (
            f"module '{name}' ({type(module).__name__}) is a transformers model, which skips _init_weights on the "
            "meta device; pass param_init_fn=model._init_weights"
        )
    return None


def _check_replay_writes_computed_buffers(root: nn.Module, program: InitProgram) -> None:
    """Refuse a non-persistent meta buffer that nothing in the recorded build writes: no checkpoint will either."""
    for name, module in root.named_modules():
        _, buffers = _own_meta(module)
        never = [
            b
            for b in buffers
            if b in module._non_persistent_buffers_set and not program.ever_written(storage_key(module._buffers[b]))
        ]
        if never:
            raise ValueError(
                f"module '{name or type(root).__name__}' ({type(module).__name__}) was built on the meta device with "
                f"the non-persistent buffer(s) {', '.join(never)}, which nothing in its build writes and no "
                "checkpoint holds; compute them in __init__, or build that module on a real device. Nothing was "
                "materialised."
            )


def _materialize_by_replay(
    root: nn.Module,
    device: torch.device,
    program: InitProgram,
    owners_of: dict[int, list[tuple[nn.Module, str]]],
    on_param_ready: Callable[[nn.Parameter, nn.Parameter], None],
) -> tuple[list[str], list[str]]:
    """Module by module in module order, each module's own tensors computed from their slice of ``program``.

    A seeded meta build then gets exactly the eager build's values and leaves the random stream where the eager build
    left it, whatever order ``__init__`` initialises in -- a parent initialising its own parameters after its child's
    (LitGPT's ``LoRALinear``), one ``self.apply(self._init_weights)`` sweep at the end (GPT-2), a buffer computed from
    ``torch.arange`` (rotary ``inv_freq``). A tied parameter gets what the eager build's ops on it left."""
    states = program.run_stream(device)
    unset: list[str] = []
    lost: list[str] = []
    for path, module in root.named_modules():
        param_names, buffer_names = _own_meta(module)
        if not param_names and not buffer_names:
            continue
        targets: dict[int, torch.Tensor] = {}
        for name in buffer_names:
            meta = module._buffers[name]
            module._buffers[name] = targets[storage_key(meta)] = _marked_empty(meta, device)
        ready = []
        for name in param_names:
            meta = module._parameters[name]
            real = nn.Parameter(_marked_empty(meta, device), requires_grad=meta.requires_grad)
            targets[storage_key(meta)] = real
            for owner, attr in owners_of.get(id(meta), [(module, name)]):
                owner._parameters[attr] = real
            ready.append((meta, real))
        with torch.no_grad():
            program.replay(targets, device, states)
        _note_unwritten(path, module, buffer_names, param_names, unset, lost)
        for meta, real in ready:
            on_param_ready(meta, real)
    states.restore_final()
    for module in root.modules():  # the program (and the real values it holds) lives only while a part awaits it
        _PROGRAM_OF.pop(module, None)
    return unset, lost


def _materialize_by_initialisers(
    root: nn.Module,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    owners_of: dict[int, list[tuple[nn.Module, str]]],
    on_param_ready: Callable[[nn.Parameter, nn.Parameter], None],
) -> tuple[list[str], list[str]]:
    """Module by module in module order, each initialised by ``param_init_fn`` or its ``reset_parameters()``.

    The way with a ``param_init_fn``, for a model put on the meta device by hand, or where the program cannot be
    replayed (the reason is logged). Each initialiser must touch only the module's own tensors, as torch's built-in
    modules do; that gives the eager values only when module (pre-)order is the order the eager ``__init__`` initialised
    them in (a parent's own parameters are initialised before its children's)."""
    stand_ins = _tied_stand_ins(owners_of)
    unset: list[str] = []  # a checkpoint loaded later may fill these
    lost: list[str] = []  # non-persistent buffers (no checkpoint holds them) the scratch trial could not judge
    for path, module in root.named_modules():
        param_names, buffer_names = _own_meta(module)
        stand_in_names = stand_ins.get(id(module), [])
        if not param_names and not buffer_names and not stand_in_names:
            continue
        for name in buffer_names:
            module._buffers[name] = _marked_empty(module._buffers[name], device)
        ready = []
        for name in param_names:
            if name in stand_in_names:
                continue
            meta = module._parameters[name]
            real = nn.Parameter(_marked_empty(meta, device), requires_grad=meta.requires_grad)
            for owner, attr in owners_of.get(id(meta), [(module, name)]):
                owner._parameters[attr] = real
            ready.append((meta, real))
        shared = {name: module._parameters[name] for name in stand_in_names}
        for name, param in shared.items():  # the eager build initialised this owner's own tensor, later replaced
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device))
        with torch.no_grad():
            _initialise(module, param_init_fn)
        for name in shared:
            module._parameters[name] = shared[name]  # meta until its initialising owner, or already real
        own_params = [name for name in param_names if name not in stand_in_names]
        _note_unwritten(path, module, buffer_names, own_params, unset, lost)
        for meta, real in ready:
            on_param_ready(meta, real)
    return unset, lost


def _note_unwritten(
    path: str, module: nn.Module, buffer_names: list[str], param_names: list[str], unset: list[str], lost: list[str]
) -> None:
    """Add the module's just-materialised tensors still holding their mark to ``lost`` (non-persistent buffers) or
    ``unset`` (the rest)."""
    written = [(name, module._buffers[name]) for name in buffer_names]
    written += [(name, module._parameters[name]) for name in param_names]
    for name, tensor in written:
        if _unwritten(tensor):
            computed = name in buffer_names and name in module._non_persistent_buffers_set
            (lost if computed else unset).append(_joined(path, name))


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"


def _tied_stand_ins(owners_of: dict[int, list[tuple[nn.Module, str]]]) -> dict[int, list[str]]:
    """For each module, the tied parameters it owns but does not initialise: every owner but the creator (the first
    owner when no creator was recorded).

    A parameter shared by several modules (weight tying) is materialised once and set on every owner, so the tie
    survives. Without a replay it takes the init an eager build gives it: that of the module that created it
    (``lm_head`` in ``wte.weight = lm_head.weight``), not of whichever owner comes first in module order.
    :func:`track_meta_build` records each meta parameter's creator (its first registration) while a model is built;
    every other owner still runs its initialiser, on a scratch tensor, so the random stream advances exactly as in the
    eager build, where each module initialised its own tensor before the tie replaced it. Without a record (a model
    built on the meta device outside that context) the first owner in module order initialises it."""
    stand_ins: dict[int, list[str]] = {}
    for owners in owners_of.values():
        if len(owners) < 2:
            continue
        module, name = owners[0]
        creator = _creator(module._parameters[name])
        initialiser = creator if any(owner is creator for owner, _ in owners) else owners[0][0]
        for owner, attr in owners:
            if owner is not initialiser:
                stand_ins.setdefault(id(owner), []).append(attr)
    return stand_ins
