"""Giving back what running a sharded model took, the model staying usable: ``release``.

[Note: what a run gives back] A sharded model's first forward sets up what its runs need (``RootContext`` in
``runtime/root.py``): a transport per process group -- on one host a shared-memory segment per rank, mapped by every
peer, in which the units keep their shards -- and the step's bookkeeping. The model holds all of it (its modules' hooks
hold the units, the units their root's context), so dropping the model gives everything back once the garbage collector
has run: nothing outside a model holds it (``registry.py`` is weak on both sides, and the gradient hooks that torch
keeps out of the collector's sight hold their unit weakly). A model that is kept (a notebook, a sweep's best trial)
would keep it all, though, a segment per fit. ``release`` gives it back at once: the shards move out of the segment into
memory of their own (the same Parameter objects, their ``.data`` swapped, so optimizer state keyed by them stays valid),
every transport is closed (its mappings dropped, its buffers freed), and the units are idle and unclaimed, so the
model's next forward sets up again (choosing its transports is a collective on every rank, as the first time). The
strategies call it at their teardown, at the end of ``fit`` and of every other stage however it ended (an exception, a
signal, ``KeyboardInterrupt``), and stop the thread they started (``hang_watch.MainThreadWatch``); the process group
stays for the next run, as Lightning leaves it after DDP.
"""

from __future__ import annotations

from torch import nn

from lightning_fsdp.engine.optimizers.step_hook import settle_step_hooks
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.runtime.root import contexts_of
from lightning_fsdp.engine.state.state_dict import forget_meshes


def release(module: nn.Module) -> None:
    """Give back what running the sharded ``module`` took: its shared-memory segments and their mappings, the
    transports' buffers, the meshes of its state dicts (see [Note: what a run gives back]). The model keeps working:
    its parameters stay readable, savable and loadable, and its next forward sets up again.

    Call it on every rank at the same point, outside a step (the next forward's set-up is a collective). Nothing is
    waited for: a collective still in flight (a run ended by an exception) is dropped. A module that never ran, or
    is not sharded, is left as it is.
    """
    for context in contexts_of(units_under(module)):
        context.release()
    forget_meshes()
    settle_step_hooks()
