"""The initialisation program of a meta-device build: recorded while the model is built, replayed to materialise it.

On the meta device the initialisers an eager ``__init__`` runs do nothing. :func:`recording` records every op on meta
tensors into an :class:`InitProgram`; materialising replays, on real tensors, the ops each module's tensors depend on,
so a seeded meta build gets exactly the eager build's values and leaves the random stream where the eager build left it.
How, and its price: [Note: replaying the eager build's init], above ``InitProgram``; what cannot be replayed:
``InitProgram.refuse``.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.nn import init
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Aten ops whose every element of ``self`` is overwritten without reading it: a write that kills earlier values.
_OVERWRITING = {
    "normal_",
    "uniform_",
    "fill_",
    "zero_",
    "copy_",
    "bernoulli_",
    "exponential_",
    "random_",
    "cauchy_",
    "log_normal_",
    "geometric_",
}
_RANDOM = {
    "normal",
    "uniform",
    "bernoulli",
    "exponential",
    "random",
    "cauchy",
    "log_normal",
    "geometric",
    "randn",
    "rand",
    "randint",
    "randperm",
    "randn_like",
    "rand_like",
    "randint_like",
    "multinomial",
    "poisson",
    "binomial",
    "native_dropout",
    "rrelu_with_noise",
    "_standard_gamma",
}
# In-place ops that change only a tensor object's shape or strides, not values: nothing to replay.
_METADATA_ONLY = {"t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "as_strided_", "detach_"}
_REPOINTING = {"resize_", "resize_as_", "set_", "_resize_output_"}
_EMPTY_FACTORIES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
# Torch initialisers that return early on a meta tensor: (the public function, its arguments after ``tensor``, random).
_META_SKIPPING_INITS = {
    init._no_grad_trunc_normal_.__code__: (init.trunc_normal_, ("mean", "std", "a", "b", "generator"), True),
    init.orthogonal_.__code__: (init.orthogonal_, ("gain", "generator"), True),
    init.dirac_.__code__: (init.dirac_, ("groups",), False),
    init.sparse_.__code__: (init.sparse_, ("sparsity", "std", "generator"), True),
}
_IS_META = torch._C.TensorBase.__dict__["is_meta"]
# Tensors built from Python data: their values never pass through an aten op the dispatch mode sees.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def storage_key(tensor: torch.Tensor) -> int:
    """One meta storage, shared by every alias of it (``.data``, the ``nn.Parameter`` wrapping it, its views)."""
    return tensor.untyped_storage()._cdata


def covers_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage, densely (any memory format)."""
    numel = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
    dense = tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))
    return tensor.storage_offset() == 0 and tensor.numel() == numel and dense


@dataclass(frozen=True)
class TensorRef:
    """A meta tensor in a recorded op: its storage and its geometry on that storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    whole: bool  # the tensor is its whole storage, densely: an overwriting op then kills every earlier value


@dataclass
class _Op:
    run: Callable[..., Any]  # an aten op, or one of _META_SKIPPING_INITS' public functions
    args: tuple[Any, ...]  # TensorRef in place of every meta tensor
    kwargs: dict[str, Any]
    outputs: list[TensorRef | None]  # the new meta tensors it returns (flattened), None for any other output
    reads: frozenset[int]
    writes: frozenset[int]
    random: bool
    generator: torch.Generator | None  # an explicit generator, else the target device's default one
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)  # what a factory's dtype=None meant

    def call(self, resolve: Callable[[TensorRef], torch.Tensor], device: torch.device) -> Any:
        def substitute(value: Any) -> Any:
            if isinstance(value, TensorRef):
                return resolve(value)
            if isinstance(value, torch.device) and value.type == "meta":
                return device
            return value

        args, kwargs = pytree.tree_map(substitute, self.args), pytree.tree_map(substitute, self.kwargs)
        outer = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            return self.run(*args, **kwargs)
        finally:
            torch.set_default_dtype(outer)


@dataclass
class StreamStates:
    """What the stream pass leaves: each random op's generator state before it, and every generator's final one."""

    before: dict[int, torch.Tensor] = field(default_factory=dict)
    final: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)

    def restore_final(self) -> None:
        for generator, state in self.final.values():
            generator.set_state(state)


# [Note: replaying the eager build's init] On the meta device every initialiser an eager ``__init__`` runs (a module's
# ``reset_parameters`` from its constructor, a model's ``self.apply(self._init_weights)``, a rotary embedding's
# ``inv_freq`` computed from ``torch.arange``) does nothing, so the values a seeded eager build gets are lost. While
# :func:`recording` is active, every op on meta tensors is recorded in global order (a ``TorchDispatchMode``: the aten
# ops ``normal_``, ``uniform_``, ``copy_``, ``arange``, ``pow``, ...), with its non-tensor arguments; a meta tensor is
# referred to by its storage and its geometry, so an op through ``.data``, a ``nn.Parameter`` wrapping or a view lands
# on the tensor it changes. What no aten op shows is seen one level up (a ``TorchFunctionMode``): the few torch
# initialisers that skip meta tensors by hand (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_``) are recorded
# whole when they ask ``tensor.is_meta``, and a tensor made from Python data (``torch.tensor([...])``, ``new_tensor``)
# is recorded with its data.
#
# Materialising replays the program on real tensors in two passes. The stream pass (``run_stream``) runs every random op
# in recorded order into scratch tensors of its geometry on the target device and keeps the generator's state before
# each, so the random stream advances exactly as in the eager build; the final state is restored at the end, so what
# runs after setup (dropout) draws what it would after the eager build. Then each module's own tensors are computed from
# their slice of the program (``replay``) -- the ops their final values depend on (an op a later one fully overwrites is
# dead and left out) -- with each random op drawing from its saved state. So modules can be materialised one at a time,
# in any order, and a model that initialises in one sweep at the end of ``__init__`` still peaks at about one unit plus
# the shards. The price is that every random op runs twice (once into scratch).
class InitProgram:
    """The ops a meta build ran on meta tensors, in order (see [Note: replaying the eager build's init])."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.storages: dict[int, tuple[int, torch.dtype]] = {}  # key -> (elements, dtype)
        self.unsupported: str | None = None
        self._alive: list[torch.Tensor] = []  # one meta tensor per storage: keeps its key from being reused
        self._writers: dict[int, list[int]] = {}

    # ----- recording --------------------------------------------------------------------------------------------

    def _ref(self, tensor: torch.Tensor) -> TensorRef:
        key = storage_key(tensor)
        if key not in self.storages:
            self.storages[key] = (tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1), tensor.dtype)
            self._alive.append(tensor)
        elif self.storages[key][1] != tensor.dtype:
            self.refuse(f"a meta tensor is viewed as {tensor.dtype} (it was created as {self.storages[key][1]})")
        return TensorRef(
            key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
            covers_storage(tensor),
        )  # fmt: skip

    def refuse(self, reason: str) -> None:
        """Mark the program as not replayable (the first reason is the one reported) and stop recording.

        The caller then falls back to running each module's initialiser. What cannot be replayed: an op that resizes or
        re-points a meta tensor's storage (``resize_``, ``set_``), one that writes a real tensor from a meta one, one
        that views a tensor as another dtype, one returning a mix of views and new tensors. Ops on meta tensors after
        the recording ended (an init applied after the meta build) are not seen."""
        if self.unsupported is None:
            self.unsupported = reason

    def record_aten(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        if self.unsupported is not None:
            return
        inputs = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        outputs = [t if isinstance(t, torch.Tensor) and t.is_meta else None for t in pytree.tree_leaves(out)]
        if not any(t.is_meta for t in inputs) and not any(t is not None for t in outputs):
            return
        name = func._schema.name.split("::")[-1]
        if name in _METADATA_ONLY:
            return
        if name in _REPOINTING:
            return self.refuse(f"{func} changes a meta tensor's storage")
        mutated = _mutated_arguments(func, args, kwargs)
        if any(not t.is_meta for t in mutated):
            return self.refuse(f"{func} writes a real tensor from a meta one")
        input_keys = {storage_key(t) for t in inputs if t.is_meta}
        fresh = [t is not None and storage_key(t) not in input_keys for t in outputs]
        if mutated and any(fresh):
            return self.refuse(f"{func} both writes a meta tensor and returns new ones")
        if not mutated:
            if not any(fresh):
                return  # a view: later ops name the storage it shares
            if any(t is not None and not new for t, new in zip(outputs, fresh, strict=True)):
                return self.refuse(f"{func} returns both views and new tensors")
            if name in _EMPTY_FACTORIES:
                for t in outputs:
                    if t is not None:
                        self._ref(t)  # a storage with no value yet
                return
        refs = {id(t): self._ref(t) for t in inputs if t.is_meta}
        killed = {
            refs[id(t)].key
            for t in mutated
            if refs[id(t)].whole and (name in _OVERWRITING or _is_out_argument(func, t, kwargs))
        }
        written = {refs[id(t)].key for t in mutated}
        read = {ref.key for tid, ref in refs.items() if tid not in {id(t) for t in mutated}} | (written - killed)
        out_refs = [self._ref(t) if t is not None and not mutated else None for t in outputs]
        written |= {ref.key for ref in out_refs if ref is not None}
        as_ref = lambda v: refs[id(v)] if isinstance(v, torch.Tensor) and v.is_meta else _frozen(v)  # noqa: E731
        schema_args = {a.name for a in func._schema.arguments}
        generator = _argument(func, args, kwargs, "generator") if "generator" in schema_args else None
        self.ops.append(
            _Op(
                func,
                pytree.tree_map(as_ref, args),
                pytree.tree_map(as_ref, kwargs),
                out_refs,
                frozenset(read),
                frozenset(written),
                name.rstrip("_") in _RANDOM or "generator" in schema_args,
                generator,
            )
        )

    def record_skipping_init(self, code: Any, frame_locals: dict[str, Any]) -> None:
        """An initialiser of ``_META_SKIPPING_INITS`` about to return early on a meta tensor: record the call."""
        if self.unsupported is not None:
            return
        run, names, random = _META_SKIPPING_INITS[code]
        ref = self._ref(frame_locals["tensor"])
        kwargs = {name: frame_locals[name] for name in names}
        reads = frozenset() if ref.whole else frozenset({ref.key})
        op = _Op(run, (ref,), kwargs, [None], reads, frozenset({ref.key}), random, kwargs.get("generator"))
        self.ops.append(op)

    def record_from_data(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """``out``, a meta tensor made from Python data, holds ``value`` (the same data on the CPU)."""
        if self.unsupported is not None:
            return
        ref = self._ref(out)
        kwargs = {"dtype": out.dtype, "device": torch.device("meta")}
        to_copy = torch.ops.aten._to_copy.default
        self.ops.append(_Op(to_copy, (value,), kwargs, [ref], frozenset(), frozenset({ref.key}), False, None))

    def finish(self) -> None:
        for index, op in enumerate(self.ops):
            for key in op.writes:
                self._writers.setdefault(key, []).append(index)

    # ----- replaying --------------------------------------------------------------------------------------------

    def ever_written(self, key: int) -> bool:
        return key in self._writers

    def run_stream(self, device: torch.device) -> StreamStates:
        """Draw every random op's numbers in recorded order into scratch; keep each one's generator state."""
        states = StreamStates()
        for index, op in enumerate(self.ops):
            if not op.random:
                continue
            generator = op.generator if op.generator is not None else _default_generator(device)
            states.before[index] = generator.get_state()
            # Only what the op reads needs a value (a valid one: ones for a probability or a std); the rest is
            # written, and how many numbers a draw takes does not depend on what the tensor held.
            scratch = {
                key: torch.ones(self.storages[key][0], dtype=self.storages[key][1], device=device) for key in op.reads
            }
            op.call(partial(_view, scratch, self.storages, device, torch.empty), device)
            states.final[id(generator)] = (generator, generator.get_state())
        return states

    def replay(self, targets: dict[int, torch.Tensor], device: torch.device, states: StreamStates) -> None:
        """Compute the final values of the storages ``targets`` (each a real tensor that is its whole storage)."""
        slots = dict(targets)
        for index in self._slice(targets):
            op = self.ops[index]
            if op.random:
                (op.generator if op.generator is not None else _default_generator(device)).set_state(
                    states.before[index]
                )
            resolve = partial(_view, slots, self.storages, device, torch.empty)
            result = op.call(resolve, device)
            for ref, value in zip(op.outputs, pytree.tree_leaves(result), strict=False):
                if ref is not None:
                    resolve(ref).copy_(value)

    def _slice(self, targets: Iterable[int]) -> list[int]:
        """The indices of the ops the final values of ``targets`` depend on, in order: the last op writing each
        needed storage before the op that needs it, and what that op reads (a partial write reads its target)."""
        chosen: set[int] = set()
        pending = [(key, len(self.ops)) for key in targets]
        while pending:
            key, before = pending.pop()
            writers = self._writers.get(key, [])
            position = bisect_left(writers, before)  # writers are in op order
            if position == 0 or writers[position - 1] in chosen:
                continue
            index = writers[position - 1]
            chosen.add(index)
            pending.extend((read, index) for read in self.ops[index].reads)
        return sorted(chosen)


def _view(
    slots: dict[int, torch.Tensor],
    storages: dict[int, tuple[int, torch.dtype]],
    device: torch.device,
    allocate: Callable[..., torch.Tensor],
    ref: TensorRef,
) -> torch.Tensor:
    """``ref``'s tensor on the real storage standing in for its meta one in ``slots`` (allocated on first use)."""
    slot = slots.get(ref.key)
    if slot is None:
        numel, dtype = storages[ref.key]
        slot = slots[ref.key] = allocate(numel, dtype=dtype, device=device)
    if tuple(slot.shape) == ref.size and tuple(slot.stride()) == ref.stride and slot.storage_offset() == ref.offset:
        return slot
    return slot.as_strided(ref.size, ref.stride, ref.offset)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def _argument(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str) -> Any:
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[position] if position < len(args) else kwargs.get(name)
    return None


def _mutated_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    mutated = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            mutated.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return mutated


def _is_out_argument(func: torch._ops.OpOverload, tensor: torch.Tensor, kwargs: dict) -> bool:
    return any(kwargs.get(a.name) is tensor for a in func._schema.arguments if a.is_out)


def _frozen(value: Any) -> Any:
    """A real tensor argument as it is now: the eager build used this value, whatever happens to it later."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _AtenRecorder(TorchDispatchMode):
    def __init__(self, program: InitProgram) -> None:
        super().__init__()
        self.program = program

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # our own look at the tensors is not the model's code
            try:
                self.program.record_aten(func, args, kwargs, out)
            except Exception as error:  # noqa: BLE001 - never break the user's build: replay just falls back
                self.program.refuse(f"recording {func} failed ({type(error).__name__}: {error})")
        return out


class _PythonLevelRecorder(TorchFunctionMode):
    """What the aten ops do not show: ``tensor.is_meta`` asked by the torch initialisers that return early on meta
    tensors, and tensors made from Python data (``torch.tensor([...])``), which reach the meta device unseen."""

    def __init__(self, program: InitProgram) -> None:
        super().__init__()
        self.program = program

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA and isinstance(out, torch.Tensor) and out.is_meta:
            data = (args[1:] if func is torch.Tensor.new_tensor else args, kwargs)  # new_tensor's self is no data
            if not any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(data)):
                try:
                    value = func(*args, **{**kwargs, "device": "cpu"})  # the same data, where it has a value
                    self.program.record_from_data(out, value)
                except Exception as error:  # noqa: BLE001 - as in _AtenRecorder
                    self.program.refuse(f"recording {func.__name__} failed ({error})")
        elif out is True and getattr(func, "__self__", None) is _IS_META:
            caller = sys._getframe(1)
            if caller.f_code in _META_SKIPPING_INITS:
                try:
                    self.program.record_skipping_init(caller.f_code, caller.f_locals)
                except Exception as error:  # noqa: BLE001 - as in _AtenRecorder
                    self.program.refuse(f"recording {caller.f_code.co_name} failed ({error})")
        return out


@contextmanager
def recording(program: InitProgram) -> Generator[None, None, None]:
    """Record into ``program`` every op on meta tensors until the block ends."""
    try:
        with _PythonLevelRecorder(program), _AtenRecorder(program):
            yield
    finally:
        program.finish()
