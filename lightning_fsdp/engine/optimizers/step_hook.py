"""A global optimizer step pre-hook held only while some objects of ours live.

[Note: a global step hook goes when its objects do, never during a step] The engine puts two checks in the steps of
every optimizer of the process (``prepare.py``'s preparation, ``state/optimizer_guard.py``'s refusal), and neither
may outlive what it is there for: the hook goes when the last object it watches is garbage-collected (see [Note:
what a run gives back] in ``state/release.py``). The collector runs whenever Python allocates, though, so it can
finalize the last object while some optimizer's ``step()`` is walking torch's dict of global pre-hooks, and
removing a hook then makes that step raise ``OrderedDict mutated during iteration``. So a removal waits while any
thread is inside an optimizer's step (its frames show torch's step wrapper) and is done at the next moment that is
safe: the next object watched or collected, or ``settle_step_hooks()``, which ``release`` and so the strategies'
teardown call. Meanwhile the hook stays, a no-op: it has nothing to look at.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any
from weakref import finalize

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

StepPreHook = Callable[[Optimizer, Any, Any], None]

_STEP_WRAPPER = Optimizer.profile_hook_step(lambda *args: None).__code__  # the frame every hooked step runs in
_ALL: list[HookWhileAlive] = []


class HookWhileAlive:
    """``hook`` is among torch's global optimizer step pre-hooks exactly while an object passed to ``watch`` lives
    (see the Note), give or take the wait for a step in progress to end."""

    def __init__(self, hook: StepPreHook) -> None:
        self._hook = hook
        self._alive: set[int] = set()  # ids of the watched objects not yet collected
        self._handle: RemovableHandle | None = None
        _ALL.append(self)

    def watch(self, obj: object) -> None:
        if id(obj) not in self._alive:
            self._alive.add(id(obj))
            finalize(obj, self._forget, id(obj))
        self.settle()

    def settle(self) -> None:
        """Install the hook if something is watched, remove it if nothing is and no step is running."""
        if self._alive and self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._hook)
        elif not self._alive and self._handle is not None and not _inside_an_optimizer_step():
            self._handle.remove()
            self._handle = None

    def _forget(self, obj_id: int) -> None:
        self._alive.discard(obj_id)
        self.settle()


def settle_step_hooks() -> None:
    """Do what a removal that had to wait for a step left undone (see the Note)."""
    for hook in _ALL:
        hook.settle()


def _inside_an_optimizer_step() -> bool:
    """Whether any thread is between the start and the end of an optimizer's hooked ``step()``."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is _STEP_WRAPPER:
                return True
            frame = frame.f_back
    return False
