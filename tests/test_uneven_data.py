"""Ranks whose data ends at different points, under the Trainer on 2 real ranks, against ddp in the same setting:
evaluation and prediction finish with ddp's values (shared memory and gloo), uneven training and a rank in another
collective raise on every rank within seconds, naming both places (see [Note: uneven evaluation] and [Note: every
wait knows where its peers are])."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning import Fabric, Trainer
from torch.utils.data import DataLoader

from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy, uneven_batches
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.transport.shm import ENV_SWITCH as SHARED_MEMORY_SWITCH
from lightning_fsdp.trainer.preemption import STUCK_WAIT_S
from tests.distributed import run_distributed
from tests.scripts.strategy_common import TINY, LitGPT, make_trainer

BATCH = 2
SLOW_S, SIGNAL_AFTER_S = 8.0, 1.5
WITHIN_S = 15.0  # "within seconds": the checks raise after ~1.5 s; the rest is the machine being shared


def _tokens(batches: int, seed: int) -> DataLoader:
    data = torch.randint(
        0, TINY.vocab_size, (batches * BATCH, TINY.block_size + 1), generator=torch.Generator().manual_seed(seed)
    )
    return DataLoader(data, batch_size=BATCH)


def _trainer(strategy: Any, **kwargs: Any) -> Trainer:
    return make_trainer(strategy, use_distributed_sampler=False, **kwargs)  # each rank its own data, as with shards


def _strategy(name: str, fabric: bool = False) -> Any:
    if name != "myfsdp":
        return "ddp"
    return FabricFSDPStrategy(auto_wrap_policy={Block}) if fabric else FSDPStrategy(auto_wrap_policy={Block})


def _model() -> LitGPT:
    torch.manual_seed(0)
    return LitGPT()


def _as_launched_rank(rank: int) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": "2"})


def _evaluations(rank: int, world_size: int, out: str) -> None:
    """validate, test, predict and the validation inside fit with 3 batches on rank 0 and 2 on rank 1."""
    _as_launched_rank(rank)
    evaluation = _tokens(3 - rank, seed=10 + rank)
    results: dict[str, Any] = {}
    for name, shared_memory in (("ddp", "1"), ("myfsdp", "1"), ("myfsdp-gloo", "0")):
        os.environ[SHARED_MEMORY_SWITCH] = shared_memory
        strategy = name.split("-")[0]
        started = time.monotonic()
        validated = _trainer(_strategy(strategy)).validate(_model(), evaluation, verbose=False)[0]["val_loss"]
        tested = _trainer(_strategy(strategy)).test(_model(), evaluation, verbose=False)[0]["test_loss"]
        predicted = _trainer(_strategy(strategy)).predict(_model(), evaluation)
        trainer = _trainer(_strategy(strategy), max_steps=3, limit_val_batches=None)
        trainer.fit(_model(), _tokens(3, seed=20 + rank), evaluation)
        results[name] = {
            "validate": float(validated),
            "test": float(tested),
            "predict": [p.sum().item() for p in predicted],
            "predict_batches": len(predicted),
            "fit_val_loss": float(trainer.callback_metrics["val_loss"]),
            "fabric": _fabric_evaluation(strategy, evaluation),
            "seconds": time.monotonic() - started,
        }
    Path(out, f"evaluations_{rank}.json").write_text(json.dumps(results))


def _fabric_evaluation(strategy: str, evaluation: DataLoader) -> dict[str, Any]:
    """A hand-written Fabric evaluation loop through ``uneven_batches``: the mean loss over every rank's batches, and
    this rank's own losses."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy(strategy, fabric=True))
    fabric.launch()  # the test's ranks exist already (LOCAL_RANK is set)
    torch.manual_seed(0)
    model = fabric.setup(GPT(TINY))
    losses = []
    with torch.no_grad():
        for batch in uneven_batches(model, fabric.setup_dataloaders(evaluation, use_distributed_sampler=False)):
            losses.append(model(batch[:, :-1], batch[:, 1:]).item())
    total = fabric.all_reduce(torch.tensor([sum(losses), len(losses)], dtype=torch.float64), reduce_op="sum")
    return {"mean_loss": (total[0] / total[1]).item(), "losses": losses}


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("uneven")
    run_distributed(_evaluations, 2, str(out), timeout=300)
    return [json.loads(Path(out, f"evaluations_{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("transport", ["myfsdp", "myfsdp-gloo"])
@pytest.mark.parametrize("what", ["validate", "test", "fit_val_loss"])
def test_uneven_evaluation_finishes_with_ddps_values(evaluations: list[dict], transport: str, what: str) -> None:
    for rank, results in enumerate(evaluations):
        assert results[transport][what] == pytest.approx(results["ddp"][what], rel=1e-5), (rank, what)


@pytest.mark.parametrize("transport", ["myfsdp", "myfsdp-gloo"])
def test_uneven_evaluation_under_fabric_finishes_with_ddps_values(evaluations: list[dict], transport: str) -> None:
    for rank, results in enumerate(evaluations):
        ours, ddp = results[transport]["fabric"], results["ddp"]["fabric"]
        assert len(ours["losses"]) == 3 - rank
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-5), rank
        assert ours["mean_loss"] == pytest.approx(ddp["mean_loss"], rel=1e-5), rank


@pytest.mark.parametrize("transport", ["myfsdp", "myfsdp-gloo"])
def test_uneven_prediction_returns_every_rank_its_own_batches(evaluations: list[dict], transport: str) -> None:
    for rank, results in enumerate(evaluations):
        assert results[transport]["predict_batches"] == 3 - rank
        assert results[transport]["predict"] == pytest.approx(results["ddp"]["predict"], rel=1e-5)


class _BarrierOnOneRank(LitGPT):
    """Rank 1 enters a barrier in its second validation step where rank 0 enters the model's gathers."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if batch_idx == 1 and self.global_rank == 1:
            self.trainer.strategy.barrier("only rank 1 is here")
        super().validation_step(batch, batch_idx)


class _SlowRankOne(LitGPT):
    """Rank 1 computes for ``SLOW_S`` before its first validation (or training) forward; rank 0 waits for it in the
    gathers and gets ``signum`` (from a timer thread of its own) while it waits."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum

    def _first_batch(self, batch_idx: int) -> None:
        if batch_idx == 0 and self.global_rank == 1:
            time.sleep(SLOW_S)
        elif batch_idx == 0:
            threading.Timer(SIGNAL_AFTER_S, os.kill, (os.getpid(), self.signum)).start()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._first_batch(batch_idx)
        super().validation_step(batch, batch_idx)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._first_batch(batch_idx)
        return super().training_step(batch, batch_idx)


def _stuck(rank: int, world_size: int, out: str, case: str) -> None:
    _as_launched_rank(rank)
    started = time.monotonic()
    try:
        if case == "training":  # 3 training batches on rank 0, 2 on rank 1
            _trainer(_strategy("myfsdp"), max_epochs=2).fit(_model(), _tokens(3 - rank, seed=30 + rank))
        elif case == "fabric-training":  # the same in a Fabric loop, which ends in a barrier
            _fabric_training(_tokens(3 - rank, seed=30 + rank))
        elif case in ("sigterm-fit", "sigint-fit"):
            torch.manual_seed(0)
            model = _SlowRankOne(signal.SIGINT if case == "sigint-fit" else signal.SIGTERM)
            _trainer(_strategy("myfsdp"), max_steps=2).fit(model, _tokens(2, seed=50 + rank))
        else:
            torch.manual_seed(0)
            model = _BarrierOnOneRank() if case == "barrier" else _SlowRankOne()
            _trainer(_strategy("myfsdp")).validate(model, _tokens(3, seed=40 + rank), verbose=False)
    except BaseException as error:  # noqa: BLE001 -- what each rank raised is the result (SIGTERM's is a SystemExit)
        result = {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
        _drop_tracebacks(error)  # their frames held what the wait they ended read (views of the segments)
        result["left_behind"] = _left_behind()  # the trainer and the model not yet collected
    else:
        result = {"error": None, "seconds": time.monotonic() - started}
    Path(out, f"{case}_{rank}.json").write_text(json.dumps(result))


def _drop_tracebacks(error: BaseException | None) -> None:
    """The tracebacks of ``error`` and of the errors it was raised in the handling of (Ctrl-C's SystemExit: the
    KeyboardInterrupt)."""
    while error is not None:
        error.__traceback__ = None
        error = error.__context__


def _left_behind() -> dict[str, Any]:
    """What of ours is still there: shared-memory mappings and threads."""
    return {
        "memfd_mappings": sum("/memfd:" in line for line in Path("/proc/self/maps").read_text().splitlines()),
        "threads": [thread.name for thread in threading.enumerate() if thread.name.startswith("lightning_fsdp")],
    }


def _fabric_training(batches: DataLoader) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=_strategy("myfsdp", fabric=True))
    fabric.launch()
    torch.manual_seed(0)
    model, optimizer = fabric.setup(GPT(TINY), torch.optim.AdamW(GPT(TINY).parameters()))
    for batch in batches:
        fabric.backward(model(batch[:, :-1], batch[:, 1:]))
        optimizer.step()
        optimizer.zero_grad()
    fabric.barrier("the end of training")


def _run_stuck(tmp_path: Path, case: str) -> list[dict]:
    """Every rank's result. A Trainer's run, however it ended (an error, SIGTERM, Ctrl-C), gave back its shared
    memory and its threads at its teardown, before the trainer and the model were collected; Fabric, which has no
    teardown, gives them back with its objects."""
    run_distributed(_stuck, 2, str(tmp_path), case, timeout=120)
    ranks = [json.loads(Path(tmp_path, f"{case}_{rank}.json").read_text()) for rank in range(2)]
    if not case.startswith("fabric"):
        for rank, result in enumerate(ranks):
            assert result["left_behind"] == {"memfd_mappings": 0, "threads": []}, (rank, result)
    return ranks


def test_uneven_training_raises_on_every_rank_naming_the_rank_and_batch(tmp_path: Path) -> None:
    """Rank 1 runs out after 2 batches and waits in the epoch-end comparison, rank 0 in Lightning's broadcast before
    its third batch: rank 1 names both; rank 0, freed when rank 1 leaves, repeats what rank 1 raised."""
    ranks = _run_stuck(tmp_path, "training")
    assert ranks[1]["error"] == "PeerElsewhereError", ranks
    assert "comparison of training batch counts (epoch 0)" in ranks[1]["message"], ranks
    assert "training_epoch_loop.py" in ranks[1]["message"], ranks  # where rank 0 is, from its watching thread
    assert ranks[0]["error"] in ("PeerElsewhereError", "PeerExitedError"), ranks
    for rank, result in enumerate(ranks):
        assert result["seconds"] < WITHIN_S, (rank, result)
        assert "after 2 batches" in result["message"], (rank, result)
        assert "same number of batches" in result["message"], (rank, result)


def test_uneven_training_under_fabric_raises_on_every_rank_within_seconds(tmp_path: Path) -> None:
    """Rank 1 ends its loop after 2 batches and enters a barrier while rank 0 gathers for its third: both raise,
    naming the barrier, the gather and how far each got (the Fabric strategy counts optimizer steps)."""
    ranks = _run_stuck(tmp_path, "fabric-training")
    assert "PeerElsewhereError" in {result["error"] for result in ranks}, ranks
    for rank, result in enumerate(ranks):
        assert result["error"] in ("PeerElsewhereError", "PeerStoppedError", "PeerExitedError"), (rank, result)
        assert result["seconds"] < WITHIN_S, (rank, result)
        assert "barrier 'the end of training'" in result["message"], (rank, result)
        assert "during training, 2 optimizer steps done" in result["message"], (rank, result)


def test_a_rank_in_another_collective_is_named_within_seconds(tmp_path: Path) -> None:
    ranks = _run_stuck(tmp_path, "barrier")
    assert "PeerElsewhereError" in {result["error"] for result in ranks}, (
        ranks
    )  # the first to see it; the other repeats it
    for rank, result in enumerate(ranks):
        assert result["error"] in ("PeerElsewhereError", "PeerStoppedError", "PeerExitedError"), (rank, result)
        assert result["seconds"] < WITHIN_S, (rank, result)
        assert "barrier 'only rank 1 is here'" in result["message"], result
        assert "all-gather" in result["message"], result


def test_sigterm_ends_a_rank_that_waits_within_seconds(tmp_path: Path) -> None:
    """Rank 0 waits in a gather for rank 1, which computes; SIGTERM ends rank 0 at once (not at the group's
    timeout), and rank 1 stops at its next wait, naming rank 0's exit."""
    ranks = _run_stuck(tmp_path, "sigterm")
    assert ranks[0]["error"] == "SIGTERMException", ranks
    assert ranks[0]["seconds"] < SIGNAL_AFTER_S + 3.0, ranks  # Trainer set-up and the wait's next check included
    assert ranks[1]["error"] == "PeerExitedError", ranks
    assert ranks[1]["seconds"] < SLOW_S + WITHIN_S, ranks


def test_sigterm_during_fit_ends_a_rank_that_waits_within_seconds(tmp_path: Path) -> None:
    """The same inside ``fit``, where a signal is otherwise acted on at the batch end by every rank together: rank 0
    never gets there, so its wait, once it has lasted ``STUCK_WAIT_S``, raises (see [Note: SIGTERM in a wait that
    does not end])."""
    ranks = _run_stuck(tmp_path, "sigterm-fit")
    assert ranks[0]["error"] == "SIGTERMException", ranks
    assert ranks[0]["seconds"] < SIGNAL_AFTER_S + STUCK_WAIT_S + 3.0, ranks
    assert ranks[1]["error"] == "PeerExitedError", ranks
    assert ranks[1]["seconds"] < SLOW_S + WITHIN_S, ranks


def test_sigint_during_fit_reaches_a_rank_that_waits(tmp_path: Path) -> None:
    """Ctrl-C lands in a wait at once (gloo's waits wake every 0.2 s, shared memory's are Python): Lightning's own
    handling of KeyboardInterrupt ends the rank (a graceful shutdown, exit status 1), and its peer stops at its next
    wait, naming the exit."""
    ranks = _run_stuck(tmp_path, "sigint-fit")
    assert ranks[0]["error"] == "SystemExit" and ranks[0]["message"] == "1", ranks
    assert ranks[0]["seconds"] < SIGNAL_AFTER_S + 4.0, ranks
    assert ranks[1]["error"] == "PeerExitedError", ranks
    assert ranks[1]["seconds"] < SLOW_S + WITHIN_S, ranks
