"""The full checkpoint file through any Lightning ``CheckpointIO`` plugin, still atomic.

Lightning hands a strategy's ``save_checkpoint`` to ``self.checkpoint_io``. Ours must stay atomic whatever plugin
the user chose: ``AtomicCheckpointIO`` wraps any plugin so that it writes into a temporary sibling that is renamed
into place when complete (``checkpoint/atomic.py``). With Lightning's ``AsyncCheckpointIO`` the write happens in a
background thread, so the rename must happen there too, after the write: the strategy puts ``AtomicCheckpointIO``
*inside* the async wrapper (see ``atomic_checkpoint_io``), never around it. Lightning's plain ``TorchCheckpointIO``
is replaced by our streaming ``torch.save`` (it would first serialise the whole checkpoint into memory). At an
fsspec URL the file is one upload instead, visible only when complete (``checkpoint/remote.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_fsdp.checkpoint.atomic import remove, tensor_bytes, write_file_atomically
from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote import remove_remote, save_full_remote

__all__ = ["AtomicCheckpointIO", "atomic_checkpoint_io"]


class AtomicCheckpointIO(CheckpointIO):
    """``inner``'s saves, written into a temporary sibling and renamed into place only when complete."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if is_remote(path) and type(self.inner) is TorchCheckpointIO:
            save_full_remote(path, checkpoint, storage_options)  # one upload: visible only when complete
            return
        if is_remote(path):  # the user's plugin writes to the store its own way
            self.inner.save_checkpoint(checkpoint, path, storage_options)
            return
        if type(self.inner) is TorchCheckpointIO and storage_options is None:
            save_full_checkpoint(path, checkpoint)
            return
        write_file_atomically(
            path,
            lambda tmp: self.inner.save_checkpoint(checkpoint, tmp, storage_options),
            expected_bytes=tensor_bytes(checkpoint),
        )

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if not is_remote(path):
            remove(path)
            return
        left = remove_remote(path)
        if left is not None:
            rank_zero_warn(f"not removing {path}: {left}")

    @override
    def teardown(self) -> None:
        self.inner.teardown()


def atomic_checkpoint_io(io: CheckpointIO) -> CheckpointIO:
    """``io`` with every save atomic: wrapped, or -- for ``AsyncCheckpointIO`` -- rebuilt around the wrapped inner."""
    if isinstance(io, AsyncCheckpointIO):
        inner = io.checkpoint_io
        if isinstance(inner, AtomicCheckpointIO):
            return io
        return AsyncCheckpointIO(AtomicCheckpointIO(inner if inner is not None else TorchCheckpointIO()))
    return io if isinstance(io, AtomicCheckpointIO) else AtomicCheckpointIO(io)
