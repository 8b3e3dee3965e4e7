"""Through the Trainer, optimizers that read whole tensors train under ``myfsdp`` to ``strategy="ddp"``'s weights.

One script (tests/scripts/strategy_optimizers.py) runs every case on 2 CPU processes: LAMB from
``configure_optimizers``, Muon beside AdamW under manual optimization, Adafactor with ``ShardedEMA`` saved in a
sharded checkpoint and restored by a new Trainer, and Prodigy, which reads across tensors and is refused at setup.
The tolerance is the engine parity tests' (see tests/engine_harness.py, [Note: parity tolerance]).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine_harness import ATOL, RTOL
from tests.strategy_scripts import run_script


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("optimizers")
    run_script("strategy_optimizers.py", out, timeout=400)
    return out


def _max_relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys()
    return max(((actual[n] - e).abs().max() / (e.abs().max() + ATOL / RTOL)).item() for n, e in expected.items())


@pytest.mark.parametrize("optimizer", ["lamb", "muon"])
def test_myfsdp_matches_ddp(results: Path, optimizer: str) -> None:
    ours, ddp = torch.load(results / f"{optimizer}_myfsdp.pt"), torch.load(results / f"{optimizer}_ddp.pt")
    assert _max_relative_error(ours, ddp) < RTOL


def test_a_sharded_checkpoint_gives_back_weights_optimizer_state_and_average(results: Path) -> None:
    saved, restored = torch.load(results / "adafactor_saved.pt"), torch.load(results / "adafactor_restored.pt")
    assert saved.keys() == restored.keys()
    assert all(torch.equal(restored[name], tensor) for name, tensor in saved.items())
    saved = torch.load(results / "adafactor_saved_state.pt", weights_only=False)
    restored = torch.load(results / "adafactor_restored_state.pt", weights_only=False)
    assert saved["average"].keys() == restored["average"].keys()
    assert all(torch.equal(restored["average"][n], t) for n, t in saved["average"].items())
    assert saved["optimizer"]["state"].keys() == restored["optimizer"]["state"].keys()
    for index, state in saved["optimizer"]["state"].items():
        assert state.keys() == restored["optimizer"]["state"][index].keys()
        assert all(torch.equal(restored["optimizer"]["state"][index][k], v) for k, v in state.items()), index
    assert any("row_var" in state for state in saved["optimizer"]["state"].values())  # Adafactor's factored state


def test_an_optimizer_that_reads_across_tensors_is_refused_before_its_first_step(results: Path) -> None:
    for rank in (0, 1):
        message, steps = json.loads((results / f"refusal.rank{rank}.json").read_text())
        assert steps == 0
        assert message.startswith("Prodigy cannot train sharded parameters exactly: its update of one parameter")
        assert "sharding_strategy='NO_SHARD'" in message
