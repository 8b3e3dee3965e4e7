"""A run gives back everything it took: many runs in one process cost what one does (see [Note: what a run gives
back] in ``lightning_fsdp/engine/release.py``).

The Trainer's sweep and Fabric's rounds run in ``scripts/teardown_sweep.py`` (Lightning's launcher starts rank 1 by
running the script again), myfsdp and ddp each in processes of their own; the engine alone runs here, under
``run_distributed``. Every figure is each rank's own, read from ``/proc/self`` after the run and a ``gc.collect()``.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

from lightning_fsdp import fully_shard, release
from tests.distributed import run_distributed
from tests.strategy_scripts import run_script

SCRIPT = "teardown_sweep.py"
LIVE_GROWTH = 1.05  # the memory in use after the last run against after the first
SHARED_MEMORY = "LIGHTNING_FSDP_SHARED_MEMORY"


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("teardown")
    run_script(SCRIPT, out, "trainer", "myfsdp")
    run_script(SCRIPT, out, "trainer", "ddp")
    run_script(SCRIPT, out, "fabric")
    return {name: _records(out, name) for name in ("trainer_myfsdp", "trainer_ddp", "fabric")}


def _figures(runs: list[dict[str, Any]]) -> str:
    """Each run's figures, for a failure's message."""
    keys = ("rss_mb", "live_mb", "memfd_mappings", "fds", "threads", "tasks")
    return "\n".join(" ".join(f"{key}={run[key]:.0f}" for key in keys) for run in runs)


def _assert_flat(runs: list[dict[str, Any]], beside: list[dict[str, Any]] | None = None) -> None:
    """The last run's footprint against the first's: no mapping, descriptor or thread more (but one kernel task:
    gloo's and the allocator's come and go), and the memory in use within ``LIVE_GROWTH``."""
    first, last = runs[0], runs[-1]
    message = f"ours:\n{_figures(runs)}" + (f"\nddp beside it:\n{_figures(beside)}" if beside else "")
    assert last["memfd_mappings"] <= first["memfd_mappings"], message
    assert last["fds"] <= first["fds"], message
    assert last["threads"] <= first["threads"], message
    assert last["tasks"] <= first["tasks"] + 1, message
    assert last["live_mb"] <= LIVE_GROWTH * first["live_mb"], message


def test_a_sweep_of_fits_stays_flat_as_under_ddp(sweeps: dict[str, list[dict[str, Any]]]) -> None:
    """20 fits in one pair of processes, shared memory and gloo alternating, one ending by an exception inside
    ``training_step``: after the last, each rank holds what it held after the first, as under ddp."""
    for ours, ddp in zip(sweeps["trainer_myfsdp"], sweeps["trainer_ddp"], strict=True):
        assert [run["raised"] is not None for run in ours["fits"]].count(True) == 1
        _assert_flat(ours["fits"], beside=ddp["fits"])
        _assert_flat(ddp["fits"])  # the reference itself: what a sweep under Lightning's own strategy holds


def test_nothing_of_a_fit_outlives_it(sweeps: dict[str, list[dict[str, Any]]]) -> None:
    """After every fit, the one that raised too: its teardown left no segment and no thread of ours (the trainer and
    the model still held), and once they were dropped the model was collected and no optimizer hook is left."""
    for rank in sweeps["trainer_myfsdp"]:
        for run in rank["fits"]:
            assert run["at_teardown"] == {"memfd_mappings": 0, "our_threads": []}, run
            assert not run["model_alive"], run
            assert run["memfd_mappings"] == 0, run
            assert run["our_threads"] == [], run
            assert run["optimizer_hooks"] == 0, run


def test_a_kept_model_works_after_its_run_without_holding_its_segment(
    sweeps: dict[str, list[dict[str, Any]]],
) -> None:
    """A model kept after ``fit`` (its weights held whole, for Adafactor, its biases by rows): its segment went with
    the run, yet it is readable, saved to a checkpoint, fitted again by a new Trainer, and its checkpoint loads into a
    fresh model under a third."""
    for rank in sweeps["trainer_myfsdp"]:
        kept = rank["kept"]
        assert kept["after_fit"]["memfd_mappings"] == 0, kept
        assert kept["after_fit"]["our_threads"] == [], kept
        assert kept["readable"] and kept["trained_again"] and kept["loaded"], kept
        assert kept["after_all"]["memfd_mappings"] == 0, kept


def test_fabric_runs_give_everything_back(sweeps: dict[str, list[dict[str, Any]]]) -> None:
    """Fabric launched five times, three models set up each time, everything dropped: no model, segment or thread
    left, the footprint flat. ``fabric.strategy.teardown()`` gives back the same at once, the models still held (and
    stepping on afterwards)."""
    for rank in sweeps["fabric"]:
        for run in rank["rounds"]:
            if run["round"] % 2:
                assert run["at_teardown"] == {"memfd_mappings": 0, "our_threads": []}, run
            assert not run["model_alive"], run
            assert run["memfd_mappings"] == 0, run
            assert run["our_threads"] == [], run
        _assert_flat(rank["rounds"])


# ----- the engine alone ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _memfd_mappings() -> int:
    return sum("/memfd:" in line for line in Path("/proc/self/maps").read_text().splitlines())


def _sharded_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(Block(), Block(), nn.Linear(64, 4)), {Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * torch.distributed.get_rank()))
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _collected_during_a_step() -> dict[str, int]:
    """The last sharded model, in a reference cycle, is collected while a plain optimizer's step walks torch's global
    step hooks (a hook before ours runs the collector): the step goes on, our hook leaving only once it is safe (see
    [Note: a global step hook goes when its objects do, never during a step] in ``optimizers/step_hook.py``)."""
    hooks = optimizer_module._global_optimizer_pre_hooks
    baseline = len(hooks)
    collector = optimizer_module.register_optimizer_step_pre_hook(lambda *args: None if gc.collect() else None)
    gc.disable()  # the collection happens inside the step, not at some allocation before it
    try:
        model, _ = _sharded_model()
        cycle: list[Any] = [model]
        cycle.append(cycle)
        del model, cycle
        weight = nn.Parameter(torch.ones(2))
        weight.grad = torch.ones(2)
        torch.optim.SGD([weight], lr=0.1).step()
    finally:
        gc.enable()
    waiting = len(hooks) - baseline - 1
    collector.remove()
    release(nn.Linear(1, 1))
    stepped = int(torch.equal(weight, torch.ones(2) - 0.1))
    return {"waiting": waiting, "after": len(hooks) - baseline, "stepped": stepped}


def _engine_alone(rank: int, world_size: int, out: str) -> None:
    result: dict[str, Any] = {"collected_during_a_step": _collected_during_a_step()}
    for transport in ("1", "0"):  # shared memory, then gloo
        os.environ[SHARED_MEMORY] = transport
        model, optimizer = _sharded_model()
        _step(model, optimizer, 0)
        during = _memfd_mappings()
        model_ref = weakref.ref(model)
        del model, optimizer
        gc.collect()
        result[transport] = {"during": during, "after": _memfd_mappings(), "alive": model_ref() is not None}
    os.environ[SHARED_MEMORY] = "1"
    runs: dict[str, Any] = {}
    for released in (False, True):  # a model released after every step against one never released
        model, optimizer = _sharded_model()
        losses, mappings = [], []
        for step in range(3):
            losses.append(_step(model, optimizer, step))
            if released:
                release(model)
            mappings.append(_memfd_mappings())
        shards = [p.detach().clone() for p in model.parameters()]
        runs[str(released)] = {"losses": losses, "mappings": mappings, "shards": shards}
        del model, optimizer
        gc.collect()
    result["same_training"] = runs["False"]["losses"] == runs["True"]["losses"] and all(
        torch.equal(a, b) for a, b in zip(runs["False"]["shards"], runs["True"]["shards"], strict=True)
    )
    result["mappings"] = {key: run["mappings"] for key, run in runs.items()}
    result["our_threads"] = [t.name for t in threading.enumerate() if t.name.startswith("lightning_fsdp")]
    Path(out, f"engine.rank{rank}.json").write_text(json.dumps(result))


def test_the_engine_alone_gives_back_a_dropped_or_released_model(tmp_path: Path) -> None:
    """``fully_shard`` without Lightning: a dropped model takes its segment with it; ``release`` gives a kept model's
    back at once, and the model trains on exactly as one never released."""
    run_distributed(_engine_alone, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        result = json.loads((tmp_path / f"engine.rank{rank}.json").read_text())
        assert result["1"]["during"] > 0, result  # the segment, mapped while the model lives
        for transport in ("1", "0"):
            assert result[transport]["after"] == 0 and not result[transport]["alive"], result
        assert result["mappings"]["True"] == [0, 0, 0], result
        assert min(result["mappings"]["False"]) > 0, result
        assert result["same_training"], result
        assert result["our_threads"] == [], result
        collected = result["collected_during_a_step"]
        assert collected["waiting"] >= 1 and collected["after"] == 0 and collected["stepped"] == 1, result
