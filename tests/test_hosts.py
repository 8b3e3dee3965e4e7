"""Ranks on several hosts, simulated on this machine by ``LIGHTNING_FSDP_HOST``: shared memory inside a host only, the
hierarchical collectives, resharding to the host and fewer bits between hosts, each trained against the unsharded
model (what crosses the link, in bytes, is measured in ``test_simulated_link.py``)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp import CrossHostPrecision, MixedPrecision, fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig, GPTEmbedding
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.diagnostics.step_stats import STEP_STATS
from lightning_fsdp.engine.options import ShardingStrategy, parse_reshard_after_forward
from lightning_fsdp.engine.runtime.registry import unit_of, units_under
from lightning_fsdp.engine.transport.compressed import LinkTransport
from lightning_fsdp.engine.transport.hierarchical import HierarchicalTransport
from lightning_fsdp.engine.transport.hosts import HOST_SWITCH, HostLayout, host_identity
from lightning_fsdp.engine.transport.identity import DIGEST_BITS
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, Run, assert_same_weights, initialize, make_optimizer, run_parity

# An untied embedding of many more rows than one step's tokens: its gradient is mostly zero rows (see [Note: an
# embedding's rows between hosts] in lightning_fsdp/engine/features/sparse_rows.py).
UNTIED_GPT = GPTConfig(vocab_size=509, block_size=16, n_layer=2, n_head=2, n_embd=18, bias=True, tie_weights=False)

# ----- without a process group -----------------------------------------------------------------------------------


def test_host_identity_is_the_kernel_unless_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOST_SWITCH, raising=False)
    with open("/proc/sys/kernel/random/boot_id") as boot:
        assert host_identity() == f"{os.uname().nodename}/{boot.read().strip()}"
    monkeypatch.setenv(HOST_SWITCH, "rack3-node7")
    assert host_identity() == "rack3-node7"


def test_host_layout_tells_equal_host_major_hosts_from_others() -> None:
    two_by_two = HostLayout(((0, 1), (2, 3)), rank=3)
    assert (two_by_two.ranks_per_host, two_by_two.host_major, two_by_two.host_index, two_by_two.local_index) == (
        2,
        True,
        1,
        1,
    )
    interleaved = HostLayout(((0, 2), (1, 3)), rank=1)
    assert interleaved.ranks_per_host == 2 and not interleaved.host_major
    uneven = HostLayout(((0, 1, 2), (3,)), rank=0)
    assert uneven.ranks_per_host is None and not uneven.host_major
    assert uneven.describe() == "2 host(s) x 1-3 rank(s)"
    assert HostLayout(((0, 1),), rank=0).single_host


def test_reshard_after_forward_and_cross_host_precision_refuse_what_they_cannot_do() -> None:
    assert parse_reshard_after_forward(None, ShardingStrategy.FULL_SHARD) is True
    assert parse_reshard_after_forward(None, ShardingStrategy.SHARD_GRAD_OP) is False
    assert parse_reshard_after_forward(8, ShardingStrategy.HYBRID_SHARD) == 8
    with pytest.raises(ValueError, match="needs sharding_strategy FULL_SHARD or HYBRID_SHARD, not SHARD_GRAD_OP"):
        parse_reshard_after_forward(2, ShardingStrategy.SHARD_GRAD_OP)
    with pytest.raises(ValueError, match="positive number of ranks"):
        parse_reshard_after_forward(0, ShardingStrategy.FULL_SHARD)
    assert CrossHostPrecision.coerce("int8") == CrossHostPrecision(gather="int8", reduce="bf16")
    assert CrossHostPrecision.coerce({"reduce": "bf16"}) == CrossHostPrecision(reduce="bf16")
    assert CrossHostPrecision.coerce(CrossHostPrecision()) is None
    with pytest.raises(ValueError, match="use 'bf16', 'int8', None"):
        CrossHostPrecision.coerce("fp8")
    with pytest.raises(ValueError, match=r"reduce='int8' is not supported"):
        CrossHostPrecision(reduce="int8")


# ----- four ranks as two hosts of two, and two ranks as two hosts of one ------------------------------------------


def _claim_host(rank: int, per_host: int) -> None:
    """This rank's simulated host, read when a root chooses its transports (see [Note: host identity])."""
    os.environ[HOST_SWITCH] = f"simhost{rank // per_host}"


def _parity_on_hosts(rank: int, world_size: int, per_host: int, runs: list[Run]) -> None:
    _claim_host(rank, per_host)
    for run in runs:
        run_parity(rank, world_size, run)


def _exact_runs(per_host: int) -> list[Run]:
    host = {"reshard_after_forward": per_host}
    runs = [
        Run(shard={"sharding_strategy": "FULL_SHARD"}),
        Run(shard={"sharding_strategy": "SHARD_GRAD_OP"}, clip_norm=0.05),
        Run(shard={"sharding_strategy": "NO_SHARD"}, steps=3, accumulate=2),
        Run(shard={"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"}, steps=4),
        Run(shard=host),
        Run(shard={**host, "forward_prefetch": True}, steps=3, accumulate=2, skip_sync=True),
        Run(shard={**host, "backward_prefetch": None}, clip_norm=0.05, checkpointing=True),
        Run(shard=host, freeze=("transformer.h.0", "lm_head"), steps=3),  # LoRA-like: frozen units and parts
    ]
    if per_host == 1:  # the untied embedding's gradient crosses by rows in the reduce-scatter
        runs += [
            Run(shard={"sharding_strategy": "FULL_SHARD"}, config=UNTIED_GPT, steps=4),
            Run(shard={"forward_prefetch": True}, config=UNTIED_GPT, steps=3, accumulate=2, skip_sync=True),
            # the embeddings as units of their own: nothing left to gather but the rows their lookups read
            Run(shard={"policy": {Block, GPTEmbedding}}, config=UNTIED_GPT, steps=3),
            # the kept units recomputed under activation checkpointing
            Run(config=UNTIED_GPT, steps=3, checkpointing=True),
        ]
    if per_host > 1:
        runs += [
            Run(shard={"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}),
            Run(shard={"sharding_strategy": "HYBRID_SHARD", "device_mesh": (1, 4), **host}, steps=3),
            # The untied embedding's gradient crosses by rows, the position embedding's (every row used) too.
            Run(shard={"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}, config=UNTIED_GPT, steps=4),
            Run(
                shard={"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)},
                config=UNTIED_GPT,
                steps=3,
                accumulate=2,
                freeze=("transformer.wpe",),
                clip_norm=0.05,
            ),
        ]
    return runs


@pytest.mark.parametrize(("world_size", "per_host"), [(4, 2), (2, 1)])
def test_exact_modes_on_two_hosts_train_as_the_unsharded_model(world_size: int, per_host: int) -> None:
    run_distributed(_parity_on_hosts, world_size, per_host, _exact_runs(per_host), timeout=600)


def _group_hosts(group: dist.ProcessGroup) -> set[str]:
    ranks = dist.get_process_group_ranks(group)
    return {f"simhost{rank // 2}" for rank in ranks}


def _transports_follow_the_hosts(rank: int, world_size: int) -> None:
    _claim_host(rank, 2)
    inputs, targets = torch.zeros(2, TINY_GPT.block_size, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)
    cases = {
        "FULL_SHARD": {},
        "HYBRID_SHARD": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)},
        "bf16": {"cross_host_precision": "bf16"},
    }
    for case, shard in cases.items():
        model = GPT(TINY_GPT)
        fully_shard(model, {Block}, **shard)
        initialize(model, inputs, targets)
        transports = [t for t in unit_of(model).context.transports.values() if t.world_size > 1]
        shared = [t for t in transports if isinstance(t, SharedMemoryTransport)]
        shared += [t.inside for t in transports if isinstance(t, HierarchicalTransport)]
        assert shared, f"[{case}] no shared memory inside a host: {transports}"
        for transport in shared:  # the point: never a segment mapped from another host
            assert len(_group_hosts(transport.group)) == 1, f"[{case}] shared memory spans hosts: {transport}"
        if case == "HYBRID_SHARD":
            kinds = sorted(type(t).__name__ for t in transports)
            assert kinds == ["GlooTransport", "SharedMemoryTransport"], f"[{case}] {kinds}"
        else:
            (world,) = transports
            assert isinstance(world, HierarchicalTransport) and world.ranks_per_host == 2, f"[{case}] {world}"
            assert _group_hosts(world.across.group) == {"simhost0", "simhost1"}
            assert isinstance(world.across, LinkTransport) == (case == "bf16"), f"[{case}] {world.across}"
        # What FSDPMonitor reports by transport: HYBRID's shards inside the host, its replicas' sum between hosts.
        before = STEP_STATS.snapshot()
        model(inputs, targets).backward()
        moved = STEP_STATS.snapshot() - before
        used = {
            key: traffic for key, traffic in moved.transports.items() if traffic.gathered_bytes + traffic.reduced_bytes
        }
        if case == "HYBRID_SHARD":
            assert set(used) == {"shm", "gloo"} and used["gloo"].gathered_bytes == 0, f"[{case}] {used}"
        else:
            assert set(used) == {"two-stage"}, f"[{case}] {used}"


def _host_resharding_keeps_backward_inside_the_host(rank: int, world_size: int) -> None:
    """One counted step each: FULL_SHARD gathers every unit but the last again in backward, between hosts;
    resharded to the host it gathers them over shared memory, and only forward's gathers cross."""
    _claim_host(rank, 2)
    config = dataclasses.replace(TINY_GPT, n_layer=5)
    inputs = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator())
    counts = {}
    for case, shard in {"FULL_SHARD": {}, "to the host": {"reshard_after_forward": 2}}.items():
        model = GPT(config)
        fully_shard(model, {Block}, **shard)
        for _ in range(2):  # the second step knows the forward order (the last unit stays gathered)
            with CollectiveCounter() as counter:
                model(inputs[:, :-1], inputs[:, 1:]).backward()
        across = [e for e in counter.events if e.op == "gloo::point_to_point_all_gather"]
        inside = [e for e in counter.events if e.op == "shm::all_gather"]
        counts[case] = (len(across), len(inside))
    units, regathered = 1 + config.n_layer, config.n_layer - 3
    # root + blocks in forward; backward regathers every block but the last three (the last one and the two that
    # backward would prefetch at once stay gathered): between hosts, or inside the host
    assert counts["FULL_SHARD"] == (units + regathered, units + regathered), counts
    assert counts["to the host"] == (units, units + regathered), counts


def _refusals(rank: int, world_size: int) -> None:
    _claim_host(rank, 2)
    model = GPT(TINY_GPT)
    fully_shard(model, {Block}, reshard_after_forward=3)
    with pytest.raises(ValueError, match="reshard_after_forward=3 is not a size .* 2 ranks on each of its hosts"):
        initialize(model, torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))


def _embedding_rows_cross_alone(rank: int, world_size: int) -> None:
    """HYBRID (2, 2): the replicas' sum sends every unit's shard whole but the untied embedding's, of which only the
    rows some replica's tokens touched cross (ids below 40 here: rows of the first shard only)."""
    _claim_host(rank, 2)
    model = GPT(UNTIED_GPT)
    fully_shard(model, {Block}, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    tokens = torch.randint(0, 40, (2, UNTIED_GPT.block_size + 1), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        with CollectiveCounter() as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
    params = [param for unit in units_under(model) for param in unit.params]
    wte = next(param for param in params if param.fqn.endswith("wte.weight"))
    assert wte.rows_sparse and not any(p.rows_sparse for p in params if p.fqn.endswith("lm_head.weight"))
    sums = [e for e in counter.events if e.kind == "all_reduce" and e.dtype == torch.float32]
    sent = sum(e.numel - DIGEST_BITS for e in sums)
    rest = sum(param.layout.shard_numel for param in params) - wte.layout.shard_numel
    touched = sent - rest
    assert 0 < touched <= 40 * wte.layout.row_numel if wte.layout.rank == 0 else touched == 0, (sent, rest)
    marks = [e for e in counter.events if e.kind == "all_reduce" and e.dtype == torch.uint8]
    assert [e.numel for e in marks] == [wte.layout.chunk_rows + 8], "one byte a row of each embedding's shard"


def _all_checks(rank: int, world_size: int) -> None:
    _embedding_rows_cross_alone(rank, world_size)
    _transports_follow_the_hosts(rank, world_size)
    _host_resharding_keeps_backward_inside_the_host(rank, world_size)
    _refusals(rank, world_size)


def test_transports_follow_the_hosts_and_host_resharding_stays_inside() -> None:
    run_distributed(_all_checks, 4, timeout=300)


# ----- an embedding's rows as they are looked up (two hosts of one rank) -------------------------------------------


class TwoLookups(nn.Module):
    """One embedding looked up twice in a forward, each time with other ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 6)
        self.head = nn.Linear(6, 64)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(first) + self.embed(second)).logsumexp(dim=-1).mean()


def _rows_looked_up_are_what_crosses(rank: int, world_size: int) -> None:
    """The root's training gather leaves the embeddings out; each lookup gathers the rows it reads from their owner
    (ids below 40: all on rank 0, whose shard holds rows 0-254); evaluation gathers them whole."""
    _claim_host(rank, 1)
    model = GPT(UNTIED_GPT)
    fully_shard(model, {Block})
    tokens = torch.randint(0, 40, (2, UNTIED_GPT.block_size + 1), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        with CollectiveCounter() as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
    params = {param.fqn: param for param in unit_of(model).params}
    wte, wpe = params["wte.weight"], params["wpe.weight"]
    root_gather = counter.events[0]
    assert root_gather.numel == sum(p.layout.shard_numel for p in params.values()) - (
        wte.layout.shard_numel + wpe.layout.shard_numel
    ), "the root's gather leaves both embeddings to their lookups"
    rows = [e.numel for e in counter.events if e.op == "gloo::point_to_point_gather_rows"]
    ids = tokens[:, :-1].unique().numel()
    # wte: rank 1 receives every row its ids name, rank 0 none; wpe: every position, half of them from the peer
    assert rows == [(ids if rank == 1 else 0) * wte.layout.row_numel, 8 * wpe.layout.row_numel], rows
    with torch.no_grad(), CollectiveCounter() as counter:
        model(tokens[:, :-1], tokens[:, 1:])
    assert counter.events[0].numel == sum(p.layout.shard_numel for p in params.values()), "evaluation: whole"
    assert not [e for e in counter.events if e.op == "gloo::point_to_point_gather_rows"]


def _rows_looked_up_are_the_whole_gathers_bits(rank: int, world_size: int) -> None:
    """Gathered by rows or whole, the same loss and the same gradients, to the bit, in fp32 and under bf16 mixed
    precision (whose rows are cast as the whole gather casts them)."""
    _claim_host(rank, 1)
    tokens = torch.randint(0, 40, (2, UNTIED_GPT.block_size + 1), generator=torch.Generator().manual_seed(rank))
    for precision in (None, MixedPrecision(param_dtype=torch.bfloat16)):
        results = []
        for by_rows in (True, False):
            torch.manual_seed(0)
            model = GPT(UNTIED_GPT)
            fully_shard(model, {Block}, mixed_precision=precision, gather_embedding_by_rows=by_rows)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (loss, grads), (whole_loss, whole_grads) = results
        assert torch.equal(loss, whole_loss) and all(map(torch.equal, grads, whole_grads)), precision


def _whole_table_reads_are_loud(rank: int, world_size: int) -> None:
    """A forward that reads the embedding's weight itself sees NaN in the rows no lookup named, unless
    ``gather_embedding_by_rows=False`` gathers it whole."""
    _claim_host(rank, 1)
    tokens = torch.randint(0, 40, (2, UNTIED_GPT.block_size + 1), generator=torch.Generator().manual_seed(rank))
    losses = {}
    for by_rows in (True, False):
        torch.manual_seed(0)
        model = GPT(UNTIED_GPT)
        fully_shard(model, {Block}, gather_embedding_by_rows=by_rows)
        loss = model(tokens[:, :-1], tokens[:, 1:]) + 1e-3 * model.wte.weight.square().sum()
        loss.backward()
        losses[by_rows] = loss.item()
    assert math.isnan(losses[True]) and math.isfinite(losses[False]), losses


def _two_lookups_train_as_the_unsharded_model(rank: int, world_size: int) -> None:
    _claim_host(rank, 1)
    torch.manual_seed(0)
    reference = TwoLookups()
    model = fully_shard(copy.deepcopy(reference))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        first, second = torch.randint(0, 64, (2, world_size * 3, 5), generator=data)
        local = slice(rank * 3, (rank + 1) * 3)
        model(first[local], second[local]).backward()
        sum(reference(first[r * 3 : (r + 1) * 3], second[r * 3 : (r + 1) * 3]) for r in range(world_size)).div(
            world_size
        ).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    assert [rows.param.fqn for rows in unit_of(model).looked_up] == ["embed.weight"]
    assert_same_weights(model, reference, "an embedding looked up twice")


def _looked_up_rows_checks(rank: int, world_size: int) -> None:
    _rows_looked_up_are_what_crosses(rank, world_size)
    _rows_looked_up_are_the_whole_gathers_bits(rank, world_size)
    _whole_table_reads_are_loud(rank, world_size)
    _two_lookups_train_as_the_unsharded_model(rank, world_size)


def test_an_embedding_crosses_hosts_by_the_rows_it_looks_up() -> None:
    run_distributed(_looked_up_rows_checks, 2, timeout=300)


# ----- fewer bits between hosts -----------------------------------------------------------------------------------

# The loss after COMPRESSED_STEPS steps of the tiny GPT, relative to the exact run's (documented in docs/multi-node.md
# from the benchmark model's 50 steps).
LOSS_TOLERANCE = 0.01
COMPRESSED_STEPS = 20


def _train_compressed(rank: int, world_size: int, per_host: int, cases: dict[str, dict]) -> None:
    """Each case against the same model trained exact, on the same hosts: the loss stays within LOSS_TOLERANCE, the
    weights move (the compression is there), and every replica holds the same parameters."""
    _claim_host(rank, per_host)
    torch.manual_seed(0)
    initial = GPT(TINY_GPT)
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=data) for _ in range(4)]
    results = {}
    for case, shard in {"exact": {}, **cases}.items():
        model = copy.deepcopy(initial)
        fully_shard(model, {Block}, **shard)
        optimizer = make_optimizer(model, param_groups=False)
        for step in range(COMPRESSED_STEPS):
            tokens = batches[(step + rank) % len(batches)]
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            tokens = batches[0]
            final = model(tokens[:, :-1], tokens[:, 1:]).item()
        with summon_full_params(model, writeback=False):
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(world_size)]
        dist.all_gather(everyone, weights)
        assert all(torch.equal(everyone[0], w) for w in everyone), f"[{case}] the replicas differ"
        results[case] = (final, weights)
    exact_loss, exact_weights = results.pop("exact")
    for case, (loss, weights) in results.items():
        assert abs(loss - exact_loss) / exact_loss < LOSS_TOLERANCE, f"[{case}] loss {loss} against exact {exact_loss}"
        assert not torch.equal(weights, exact_weights), f"[{case}] trained bit for bit as exact: nothing compressed"


COMPRESSED = {
    "bf16": {"cross_host_precision": "bf16"},
    "int8": {"cross_host_precision": "int8", "reshard_after_forward": 2},
    "bf16 gathers, exact reductions": {"cross_host_precision": CrossHostPrecision(gather="bf16")},
    "hybrid bf16": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2), "cross_host_precision": "bf16"},
    "no_shard bf16": {"sharding_strategy": "NO_SHARD", "cross_host_precision": "bf16"},
}


@pytest.mark.parametrize(("world_size", "per_host"), [(4, 2), (2, 1)])
def test_fewer_bits_between_hosts_stay_within_their_tolerance(world_size: int, per_host: int) -> None:
    cases = COMPRESSED if per_host > 1 else {k: v for k, v in COMPRESSED.items() if "hybrid" not in k}
    if per_host == 1:
        cases = {k: {**v, "reshard_after_forward": None} if "int8" in k else v for k, v in cases.items()}
    run_distributed(_train_compressed, world_size, per_host, cases, timeout=600)
