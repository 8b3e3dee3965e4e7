"""Many runs in one pair of processes, as a sweep or a notebook makes them: what each rank holds after every one.

- ``trainer STRATEGY``: 20 ``Trainer(devices=2).fit`` calls, each trainer and model dropped afterwards (``del``,
  ``gc.collect()``), alternating shared memory and gloo (``LIGHTNING_FSDP_SHARED_MEMORY``); fit ``FAILING_FIT`` ends
  by an exception inside ``training_step``. Under ``myfsdp`` a model kept after ``fit`` follows: read, saved, fitted
  again by a new Trainer, its checkpoint loaded into a fresh model by a third.
- ``fabric``: ``ROUNDS`` times a Fabric launched, three models set up and stepped, everything dropped.

After every run each rank records its footprint (``/proc/self``: resident memory, ``/memfd:`` mappings, descriptors,
Python threads and kernel tasks), the names of the threads of ours still alive, torch's global optimizer hooks, and
whether the dropped model was collected; after a fit also the mappings and threads of ours right after its teardown,
before anything is dropped. Each rank writes OUT_DIR/<case>.rank<r>.json.

Usage: python tests/scripts/teardown_sweep.py OUT_DIR trainer myfsdp|ddp  |  OUT_DIR fabric
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from strategy_common import make_trainer, out_dir
from torch import nn
from torch.optim import optimizer as optimizer_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

FITS = 20
FAILING_FIT = 10  # 0-based: this fit raises in its second training step, on every rank
ROUNDS = 5
WIDTH, BLOCKS, STEPS = 512, 4, 2  # 1.05M parameters (4.2 MB); two steps of two batches of 4 per rank


class PlannedFailure(RuntimeError):
    """What the failing fit raises inside ``training_step``."""


class Blocks(L.LightningModule):
    def __init__(self, fails: bool = False, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)))
        self.fails = fails
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fails and batch_idx == 1:
            raise PlannedFailure("the planned failure inside training_step")
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8 * STEPS, WIDTH, generator=torch.Generator().manual_seed(0))), 4)


def resident_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def footprint() -> dict[str, Any]:
    """This process's footprint, read from ``/proc/self``, and what of ours is still alive. ``live_mb`` is the
    resident memory once malloc has given back what it keeps free for reuse (``malloc_trim``; the engine keeps more
    on purpose, see ``engine/features/host_memory.py``): what is still in use, whatever the allocator's history."""
    rss_mb = resident_mb()
    ctypes.CDLL(None).malloc_trim(0)
    return {
        "rss_mb": rss_mb,
        "live_mb": resident_mb(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "optimizer_hooks": len(optimizer_module._global_optimizer_pre_hooks),
        **left_by_the_run(),
    }


def left_by_the_run() -> dict[str, Any]:
    """What of the run's the teardown did not give back, whatever still holds the run's objects."""
    return {
        "memfd_mappings": sum("/memfd:" in line for line in Path("/proc/self/maps").read_text().splitlines()),
        "our_threads": [t.name for t in threading.enumerate() if t.name.startswith("lightning_fsdp")],
    }


def full_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's full weights on every rank (a collective): rank 0's full state dict, broadcast."""
    state = [trainer.strategy.lightning_module_state_dict()]  # gathered on rank 0, {} elsewhere
    dist.broadcast_object_list(state, 0)
    return state[0]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def sweep(strategy: str) -> list[dict[str, Any]]:
    records = []
    for fit in range(FITS):
        os.environ["LIGHTNING_FSDP_SHARED_MEMORY"] = str(fit % 2)
        model = Blocks(fails=fit == FAILING_FIT)
        trainer = make_trainer(strategy, max_steps=STEPS)
        raised = None
        try:
            trainer.fit(model, data())
        except PlannedFailure as error:
            raised = str(error)
        at_teardown = left_by_the_run()  # the trainer and the model still alive
        model_ref = weakref.ref(model)
        del trainer, model
        gc.collect()
        run = {"fit": fit, "raised": raised, "at_teardown": at_teardown, "model_alive": model_ref() is not None}
        records.append({**run, **footprint()})
    os.environ.pop("LIGHTNING_FSDP_SHARED_MEMORY")
    return records


def kept_model(tmp: Path) -> dict[str, Any]:
    """A model kept after ``fit``: its segment gone with the run, still read, saved, trained and loaded. Adafactor
    reads whole matrices: the weights live whole on one rank (in the segment too), the biases by rows."""
    model = Blocks(optimizer=torch.optim.Adafactor)
    first = make_trainer("myfsdp", max_steps=STEPS)
    first.fit(model, data())
    after_fit = footprint()
    readable = all(bool(p.detach().isfinite().all()) for p in model.parameters())
    weights = full_weights(first)
    first.save_checkpoint(tmp / "kept.ckpt")  # rank 0 writes it; a collective all the same
    second = make_trainer("myfsdp", max_steps=STEPS)
    second.fit(model, data())
    trained_again = not same(full_weights(second), weights)
    fresh = Blocks(optimizer=torch.optim.Adafactor)
    third = make_trainer("myfsdp", max_steps=STEPS)  # the checkpoint is at max_steps: loaded, nothing trained
    third.fit(fresh, data(), ckpt_path=tmp / "kept.ckpt")
    return {
        "after_fit": after_fit,
        "readable": readable,
        "trained_again": trained_again,
        "loaded": same(full_weights(third), weights),
        "after_all": footprint(),
    }


def fabric_step(fabric: L.Fabric, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fabric.backward(model(torch.randn(4, WIDTH)).square().mean())
    optimizer.step()


def fabric_rounds() -> list[dict[str, Any]]:
    """Odd rounds end with ``fabric.strategy.teardown()`` (what it left, the models still held), after which the
    models step once more; every round ends by dropping everything."""
    records = []
    for round_ in range(ROUNDS):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="myfsdp")
        fabric.launch()
        refs, models = [], []
        for _ in range(3):
            module = Blocks()
            model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters()))
            fabric_step(fabric, model, optimizer)
            refs.append(weakref.ref(module))
            models.append((model, optimizer))
        at_teardown = None
        if round_ % 2:
            fabric.strategy.teardown()
            at_teardown = left_by_the_run()
            for model, optimizer in models:
                fabric_step(fabric, model, optimizer)  # still usable: its next forward sets up again
        del fabric, module, model, optimizer, models
        gc.collect()
        run = {"round": round_, "at_teardown": at_teardown, "model_alive": any(ref() is not None for ref in refs)}
        records.append({**run, **footprint()})
    return records


def main() -> None:
    case = sys.argv[2]
    torch.set_num_threads(1)
    if case == "trainer":
        strategy = sys.argv[3]
        result: dict[str, Any] = {"before": footprint(), "fits": sweep(strategy)}
        if strategy == "myfsdp":
            tmp = out_dir() / "kept"
            tmp.mkdir(exist_ok=True)
            result["kept"] = kept_model(tmp)
        name = f"trainer_{strategy}"
    else:
        result, name = {"before": footprint(), "rounds": fabric_rounds()}, "fabric"
    (out_dir() / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()  # the process group outlives the runs (as Lightning leaves it): no rank leaves before the others
    exit_after_distributed_run()


if __name__ == "__main__":
    main()
