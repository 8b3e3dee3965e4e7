"""The memory estimator: exact steady-state bytes against what a sharded model really holds, and its uses."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.estimate import estimate_memory, format_table, largest_trainable, main
from tests.distributed import run_distributed

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=64)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _check_against_measured(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # every rank builds the same model
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        model = fully_shard(GPT(CONFIG), {Block}, sharding_strategy=strategy)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size + 1))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        params = list(model.parameters())
        state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        measured = _storage_bytes(params) + _storage_bytes([p.grad for p in params]) + _storage_bytes(state)
        estimate = estimate_memory(GPT(CONFIG), world_size, strategy).steady
        assert abs(measured - estimate) <= 0.1 * measured, f"[{strategy}] estimated {estimate} B, measured {measured} B"


def test_estimate_matches_measured_steady_state_within_ten_percent() -> None:
    run_distributed(_check_against_measured, 2)


def test_sharding_fits_a_larger_model_in_the_same_budget() -> None:
    budget = 16 * 1024**3
    ddp = largest_trainable(budget, 2, "DDP")
    ours = largest_trainable(budget, 2, "FULL_SHARD", largest_unit=0)
    assert ours >= 1.8 * ddp
    assert estimate_memory(ddp, 2, "DDP").peak <= budget < estimate_memory(ddp + 1, 2, "DDP").peak


def test_offload_moves_the_steady_state_to_cpu_and_the_table_prints(capsys) -> None:
    on_device = estimate_memory(10**9, 8, "FULL_SHARD")
    offloaded = estimate_memory(10**9, 8, "FULL_SHARD", cpu_offload=True)
    assert offloaded.steady == 0 and offloaded.cpu_offloaded == on_device.steady
    assert "FULL_SHARD" in format_table([on_device])
    main(["--params", "1.3e9", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "SHARD_GRAD_OP" in out and "DDP" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--params", "1e9", "--world-size", "0"], "--world-size 0 must be at least 1"),
        (["--params", "-5", "--world-size", "2"], "--params -5 must be a positive parameter count"),
        (["--params", "nan", "--world-size", "2"], "--params nan must be a positive parameter count"),
        (["--params", "1e9", "--world-size", "8", "--shard-size", "3"], "--shard-size 3 must divide --world-size 8"),
        (["--params", "1e9", "--world-size", "8", "--largest-unit", "2e9"], "--largest-unit 2e+09 must lie between"),
        (["--params", "1e9", "--world-size", "8", "--bytes-per-param", "0"], "--bytes-per-param 0 must be the byte"),
    ],
)
def test_bad_estimate_arguments_are_usage_errors_naming_the_value(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert named in captured.err and captured.out == "", "one usage error, no table and no traceback"


def test_help_lists_every_subcommand_with_one_line(capsys) -> None:
    from lightning_fsdp.cli import SUBCOMMANDS
    from lightning_fsdp.cli import main as cli_main

    cli_main(["--help"])
    listing = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "convert", "estimate"):
        assert f"    {name} " in listing and SUBCOMMANDS[name][:30] in " ".join(listing.split()), name
