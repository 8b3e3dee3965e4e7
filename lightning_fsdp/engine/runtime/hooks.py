"""The runtime flow of one training step, from the root's first forward hook to the callback that ends backward.

Read top to bottom, this file is the six stages of a step (``docs/design.md``):

1. root pre-forward: lazy init (the one place for root-only decisions), unshard the root;
2. unit pre-forward: unshard (or wait for the prefetched gather), prefetch the next unit in forward order;
3. unit post-forward: reshard (FULL_SHARD, non-root, not the last unit), hook the outputs so backward announces
   itself;
4. unit pre-backward: unshard again, prefetch the unit backward reaches next (BACKWARD_PRE);
5. unit post-backward, once the unit's whole backward has run: reshard, reduce;
6. root post-backward, a callback queued on the autograd engine: finish every reduction, reshard what is left.

What the units of one root share -- the forward order, the prefetches, the reductions in flight, the end-of-backward
callback -- is ``RootContext`` in ``root.py``. The subtle parts are explained in Notes beside the code they concern.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from lightning_fsdp.engine.options import BackwardPrefetch
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.runtime.root import RootContext
from lightning_fsdp.engine.runtime.unit import FSDPUnit

log = logging.getLogger(__name__)


def context_of(unit: FSDPUnit) -> RootContext:
    """The context of the root ``unit`` runs under; the first forward through a unit no root claimed makes it one."""
    if unit.context is None:
        RootContext(unit).lazy_init()
    context = unit.context
    assert isinstance(context, RootContext)  # units are claimed by roots only
    return context


# ----- stages 1-3: forward -----------------------------------------------------------------------------------------


# [Note: hooks stay out of compiled graphs] ``torch.compile`` of the whole model would otherwise trace these hooks: the
# gathers, the storage resizes and the unit state machine are Python side effects on tensors whose sizes dynamo makes
# symbolic (automatic dynamic shapes), and the traced ``split_with_sizes_copy`` then rejects them. So the runtime entry
# points (pre-/post-forward, pre-backward, gradient accumulated, input gradients) are ``torch.compiler.disable``d:
# dynamo breaks the graph around each hook call and runs the hook eagerly, and the compute between hooks -- the blocks
# themselves -- compiles into graphs. The full parameters keep their identity across steps
# (see [Note: storage freeing and tensor identity] in ``param.py``), so the graphs' guards on them hold and nothing
# recompiles. ``tests/test_engine_compile.py`` checks that no hook is a frame of its own.
@torch.compiler.disable  # see [Note: hooks stay out of compiled graphs]
def pre_forward(unit: FSDPUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    context = context_of(unit)
    if unit.is_recomputing:  # under activation checkpointing
        unit.use()
        return None
    if unit.is_root:
        context.sync_buffers_for_evaluation(module.training)
        if not unit.in_forward:
            context.backwards_before_forward = context.backwards_finished
    context.note_entered(unit, outermost=not unit.in_forward)
    unit.begin_forward(records_grads=torch.is_grad_enabled())
    if torch.is_grad_enabled():
        context.record_forward(unit)
    context.unshard_for_use(unit, context.next_units(unit, +1) if context.prefetches_forward(unit) else [])
    if torch.is_grad_enabled():
        unit.hook_trainable_params(functools.partial(_on_grad_accumulated_weakly, weakref.ref(unit)))
    precision = unit.options.mixed_precision
    cast = precision.cast_forward_inputs and precision.param_dtype is not None
    if cast:
        args, kwargs = _cast_floating(args, precision.param_dtype), _cast_floating(kwargs, precision.param_dtype)
    if torch.is_grad_enabled() and unit.has_frozen_sharded_params():
        _hook_input_grads(unit, args, kwargs)
    return (args, kwargs) if cast else None


def _hook_input_grads(unit: FSDPUnit, args: tuple, kwargs: dict) -> None:
    """See [Note: post-backward of partly frozen units]."""
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    unit.expect_input_grads(bool(inputs))
    if inputs:
        register_multi_grad_hook(inputs, lambda _grads: on_input_grads(unit), mode="all")


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# [Note: backward inside a forward] Under Lightning the root unit's forward is the whole training_step, and with manual
# optimization that step runs backward itself, maybe several times (a GAN: one per optimizer). A unit whose forward is
# still running when a backward ends must stay gathered: the rest of its forward uses its parameters. So post-backward
# and the final callback leave a unit with ``in_forward`` set gathered (its gradients are reduced as usual), and its own
# post-forward decides as it always does -- except the root's: a backward that finished inside the root's forward was
# that step's backward, and the output it returns (Lightning's logged loss) is not backwarded again, so its post-forward
# reshards every unit, as after an evaluation forward. Otherwise the root would stay gathered until the next step: more
# memory between steps, and a checkpoint at the batch end (``ModelCheckpoint``, the SLURM requeue) would see full
# parameters where the optimizer holds shards. Should a backward come after all, its pre-backward gathers the root
# again.
@torch.compiler.disable  # see [Note: hooks stay out of compiled graphs]
def post_forward(unit: FSDPUnit, module: nn.Module, args: tuple, output: Any) -> Any:
    context = context_of(unit)
    if unit.is_recomputing:  # backward needs the parameters next
        return output
    unit.end_forward()
    backward_next = torch.is_grad_enabled() and context.gathered_when_backward_starts(unit)
    if not unit.is_root and not backward_next:
        unit.end_forward_gathered()
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors and torch.is_grad_enabled():
        register_multi_grad_hook(tensors, lambda _grad: pre_backward(unit), mode="any")
    elif unit.is_root:  # no graph to run backward through (eval, no_grad): leave nothing unsharded
        context.reshard_all()
    if unit.is_root and not unit.in_forward:
        context.end_entering()
        if context.backwards_finished != context.backwards_before_forward:  # the step's backward ran inside it
            context.reshard_all()
    return output


# ----- stages 4-5: backward ----------------------------------------------------------------------------------------


# [Note: why the pre-backward hook sits on the outputs] Autograd runs a unit's backward right after the gradients of its
# outputs exist, so a hook on those outputs (registered by ``post_forward``) is the first moment the unit's full
# parameters are needed again -- and it fires before any op inside the unit. A unit called twice gets two hooks; the
# second finds it unsharded.
@torch.compiler.disable  # see [Note: hooks stay out of compiled graphs]
def pre_backward(unit: FSDPUnit) -> None:
    context = context_of(unit)
    context.queue_final_callback()
    if not unit.begin_backward():
        return
    context.reduce_early_grads(besides=unit)
    prefetch = unit.options.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    context.unshard_for_use(unit, context.next_units(unit, -1) if prefetch else [])


@torch.compiler.disable  # see [Note: hooks stay out of compiled graphs]
def on_grad_accumulated(unit: FSDPUnit, param: torch.Tensor) -> None:
    # A backward that no unit's output hook announced (it ran inside the only unit's forward) still ends in stage 6.
    context = context_of(unit)
    context.queue_final_callback()
    unit.grad_accumulated(param)
    _post_backward_if_done(unit)
    if unit.backward_unfinished:
        context.note_early_grads(unit)


def _on_grad_accumulated_weakly(unit_ref: weakref.ref[FSDPUnit], param: torch.Tensor) -> None:
    """The post-accumulate-grad hook holds its unit weakly: torch keeps such hooks on the tensor's C++ side, which the
    garbage collector does not see through, so a hook holding the unit (which holds the tensor) would be a cycle never
    collected, keeping the model and its shared-memory segment alive for the rest of the process."""
    unit = unit_ref()
    if unit is not None:
        on_grad_accumulated(unit, param)


@torch.compiler.disable  # see [Note: hooks stay out of compiled graphs]
def on_input_grads(unit: FSDPUnit) -> None:
    unit.input_grads_arrived()
    _post_backward_if_done(unit)


# [Note: post-backward by counting] A post-accumulate-grad hook fires exactly once per backward for every leaf that
# received a gradient, after all its uses have been summed (a unit called twice included). When the count reaches the
# unit's trainable parameters, its gradients are complete. A unit some of whose parameters got no gradient (an unused
# branch) is reduced by the final callback instead, in reverse forward order on every rank alike.
#
# [Note: post-backward of partly frozen units] Complete gradients do not mean a finished backward when some of the
# unit's parameters are frozen: a frozen norm used first in forward is read last in backward, to compute the gradient of
# the unit's input, after every trainable gradient is in. Resharding then would free memory autograd is about to read
# (SIGSEGV with RMSNorm, wrong input gradients when the memory is reused). A unit with a frozen sharded parameter
# therefore also waits for the gradients of its forward inputs -- a hook on the inputs that need one
# (``_hook_input_grads``), as torch's FSDP2 does -- and, when none of its inputs needs a gradient (the first unit, whose
# inputs are token ids), for the final callback. Which nodes can read a frozen parameter: one whose outputs are
# gradients of trainable parameters (it runs before their accumulation, so the count covers it) or of the unit's inputs
# (the input hook covers it). Units with every parameter trainable keep the count alone, so their reductions start as
# soon as their gradients are in.
def _post_backward_if_done(unit: FSDPUnit) -> None:
    """Stage 5 once the unit's backward is complete (see the two Notes right above)."""
    if unit.backward_complete:
        post_backward(unit)


def post_backward(unit: FSDPUnit) -> None:
    context_of(unit).post_backward(unit)


# [Note: a submodule called while its unit is sharded] A unit gathers its parameters in its own forward, so a call
# straight into one of its submodules from outside (``pl_module.model(x)`` in a Lightning callback, whose root unit is
# the LightningModule) finds this rank's rows where the full tensors belong, and fails deep inside with whatever the op
# makes of the wrong shape (an embedding's bare ``IndexError``), or silently computes with the rows. The root unit
# therefore puts one forward pre-hook on each of its direct children that uses its sharded parameters (not on units, not
# deeper): it raises a sentence naming the unit and the fix when the root does not show its full parameters. That is a
# handful of cheap checks per step, at the root only: the root is what code outside the forward reaches into, and a hook
# on every submodule of every unit would tax each forward. A call into a non-root unit's submodule is not guarded.
# ``fully_shard`` on a parent makes a new root, and the old root's guards are removed.
def guard_ungathered_calls(root: FSDPUnit) -> None:
    """Hook the root's direct children that use its sharded parameters (see the Note right above)."""
    owners = {id(module) for fsdp_param in root.params if not fsdp_param.is_whole for module, _ in fsdp_param.owners}
    handles = [
        child.register_forward_pre_hook(lambda module, args, name=name: _refuse_if_sharded(root, module, name))
        for name, child in root.module.named_children()
        if unit_of(child) is None and any(id(m) in owners for m in child.modules())
    ]
    root.guard_calls(handles)


def _refuse_if_sharded(unit: FSDPUnit, module: nn.Module, name: str) -> None:
    if not unit.shows_full_params:
        raise RuntimeError(
            f"{type(module).__name__} `{name}` was called on its own while the sharded unit it belongs to "
            f"({type(unit.module).__name__}) holds only this rank's rows of its parameters, which it gathers in its "
            f"own forward; call the sharded {type(unit.module).__name__} itself (under Lightning, the LightningModule) "
            "or make the call inside `with lightning_fsdp.summon_full_params(<the sharded model>):`."
        )


# [Note: units compile with static sizes] Around the hooks' graph breaks (see [Note: hooks stay out of compiled graphs])
# each unit's forward is a frame of its own, and the units of one class (a ResNet's BasicBlocks of different widths and
# strides) share one code object: dynamo compiles it once per unit and, when a guarded size or int differs from the unit
# before, makes it symbolic ("automatic dynamic shapes"). What keeps plain torch static there is that module attributes
# are specialised: parameters, buffers and ints such as a convolution's stride of an ordinary module are constants of
# the graph. A module marked ``_is_fsdp_managed_module`` is wrapped as torch FSDP1's instead, whose buffers and ints are
# neither, so every block after the first would recompile with symbolic sizes (which inductor can fail on: "Cannot
# convert expression to float"). Hence ``fully_shard`` marks only the models and containers above the units, which
# libraries ask (see ``_mark_fsdp_managed`` in api.py), never a unit's own modules; and the hooks are registered as
# partials of the disabled functions, not lambdas, so no hook is a frame of its own that dynamo compiles (and recompiles
# per input shape). Each unit then compiles once with its modules' sizes and ints static; only an input whose sizes
# differ from the unit compiled before still becomes symbolic, as in plain torch. ``tests/test_engine_compile_conv.py``
# checks it.
def install_hooks(unit: FSDPUnit) -> None:
    """Registered once per unit; nothing is re-registered per step except the hook on each forward's outputs."""
    # Partials, not lambdas: see [Note: units compile with static sizes].
    unit.module.register_forward_pre_hook(functools.partial(pre_forward, unit), with_kwargs=True)
    # always_call: a forward that raises (a user catching out-of-memory to retry smaller) still ends the unit's
    # forward and, the output being None, reshards what it gathered.
    unit.module.register_forward_hook(functools.partial(post_forward, unit), always_call=True)
