"""The shared-memory transport: slots every rank agrees on, the gloo fallback, and no slot rewritten while read."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.transport import CHUNK_SWITCH, Pending, chunk_limit, packing, shm
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.identity import CollectiveMismatchError, Ledger
from lightning_fsdp.engine.transport.packing import RankRows
from lightning_fsdp.engine.transport.shm import SLOTS, SharedMemoryTransport, homes, peer_wait, segment
from lightning_fsdp.engine.transport.shm.peer_wait import PeerExitedError
from tests.distributed import run_distributed


def _open_segment_descriptors() -> list[str]:
    """This process's open descriptors of shared-memory segments: none once a transport exists (or failed)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone by now
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{shm.SEGMENT_NAME}-"):
                found.append(fd)
    return found


def _mapped_segments() -> set[str]:
    """The segments this process maps, by name (``lightning_fsdp-<creator pid>``)."""
    with open("/proc/self/maps") as maps:
        return {line.split("/memfd:")[1].split()[0] for line in maps if f"/memfd:{shm.SEGMENT_NAME}-" in line}


def _dev_shm_entries_of(pids: list[int]) -> list[str]:
    """Files in /dev/shm whose name carries one of ``pids`` -- other jobs on the machine may have their own there."""
    return [name for name in os.listdir("/dev/shm") if any(str(pid) in name for pid in pids)]


SIZES = {"all_gather": 1024, "reduce_scatter": 1024}
GATHERS = SLOTS["all_gather"]


def _create(sizes: dict[str, int] = SIZES) -> SharedMemoryTransport | None:
    return SharedMemoryTransport.create(dist.group.WORLD, sizes)[0]


def _gather(value: float, transport: SharedMemoryTransport) -> Pending[list[torch.Tensor]]:
    return transport.all_gather([torch.full((5,), value)], torch.float32, None)


def _check_slots(rank: int, world_size: int) -> None:
    pids: list[int | None] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    transport = _create({"all_gather": 1000, "reduce_scatter": 3000, "all_reduce": 100})
    assert transport is not None, "ranks of one host share memory"
    assert {kind: slots.slot_bytes for kind, slots in transport.slots.items()} == {"all_gather": 1024, "reduce": 3008}
    slots_bytes = 3 * (64 + 1024) + 2 * (64 + 3008)  # sized per collective kind, not 4 x the largest
    assert transport.resident_bytes == 64 + slots_bytes, "the rank's header, then the slots"
    assert _open_segment_descriptors() == [], "the creator's descriptor is closed once every rank has mapped it"
    assert _mapped_segments() == {f"{shm.SEGMENT_NAME}-{pid}" for pid in pids}, "every rank's segment, mapped"
    assert _dev_shm_entries_of(pids) == [], "nothing of this run in /dev/shm"

    slots = transport.slots["all_gather"]
    assert slots.acquire(slots.slot_bytes + 1) is None, "a chunk never outgrows its slot"
    assert [slots.acquire(8) for _ in range(GATHERS)] == [0, 1, 2], "every slot once"
    assert slots.acquire(8) is None, "every slot in flight: the next collective goes over gloo"
    slots.release(2)
    slots.release(0)
    assert slots.acquire(8) == 2, "the slot free the longest first"
    slots.release(2)
    slots.release(1)
    assert [slots.acquire(8) for _ in range(GATHERS)] == [0, 2, 1], "in the order they were released"
    for slot in range(GATHERS):
        slots.release(slot)

    # More gathers in flight than slots, finished in reverse order: the first ones through shared memory, the
    # rest over gloo, every value right on every rank.
    with CollectiveCounter() as counter:
        pending = [_gather(10.0 * i + rank, transport) for i in range(GATHERS + 3)]
    assert [event.op for event in counter.events if event.kind == "all_gather"] == ["shm::all_gather"] * GATHERS + [
        "c10d::_allgather_base_"
    ] * 3
    for i in reversed(range(len(pending))):
        blocks = pending[i].wait()
        assert [block.tolist() for block in blocks] == [[10.0 * i + r] * 5 for r in range(world_size)]
        pending[i].release()


def _check_no_rewrite_before_everyone_read(rank: int, world_size: int) -> None:
    """Rank 0 races ahead into the next collective, which must take the same slot; the slow rank still reads."""
    transport = _create()
    assert transport is not None
    slots = transport.slots["all_gather"]
    held = [slots.acquire(8) for _ in range(GATHERS - 1)]  # one slot left for the two collectives below
    first = _gather(1.0 + rank, transport)
    if rank == world_size - 1:
        first.wait()
        time.sleep(1.0)  # everyone else has read and moved on; this rank has not read yet
        assert [block.tolist() for block in first.wait()] == [[1.0 + r] * 5 for r in range(world_size)]
    first.release()
    with CollectiveCounter() as counter:
        second = _gather(100.0 + rank, transport)
    assert [event.op for event in counter.events if event.kind == "all_gather"] == ["shm::all_gather"]
    assert slots.acquire(8) is None, "the second took the only free slot again"
    assert [block.tolist() for block in second.wait()] == [[100.0 + r] * 5 for r in range(world_size)]
    second.release()
    assert None not in held

    # Ranks in different kinds of collective (a gather here, a reduction there) never move the counters the
    # other waits on; each names the other's collective at once instead of waiting for the timeout.
    transport = _create()
    assert transport is not None
    ledger = Ledger(["blocks.0", "blocks.1"])
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match=r"rank \d is in the (all-gather|reduce-scatter) #1 of unit "):
        if rank == 0:
            transport.all_gather([torch.ones(5)], torch.float32, ledger.stamp("all-gather", 20, "blocks.0")).wait()
        else:
            grads = [RankRows(torch.ones(world_size * 5), 5)]
            transport.reduce_scatter(grads, torch.float32, ledger.stamp("reduce-scatter", 40, "blocks.1")).wait()
    assert time.monotonic() - start < 10.0


def _check_every_rank_agrees_to_fall_back(rank: int, world_size: int) -> None:
    os.environ[shm.ENV_SWITCH] = "0" if rank == 1 else "1"  # switched off on one rank only
    transport, reason = SharedMemoryTransport.create(dist.group.WORLD, SIZES)
    assert transport is None and "switched off (LIGHTNING_FSDP_SHARED_MEMORY=0)" in reason
    os.environ[shm.ENV_SWITCH] = "1"
    real_fallocate = os.posix_fallocate
    if rank == 1:  # memory is short when rank 1 reserves its segment

        def out_of_room(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = out_of_room
    assert _create() is None
    os.posix_fallocate = real_fallocate
    assert _open_segment_descriptors() == [], "every rank closed the segment it had reserved"
    assert _mapped_segments() == set(), "and maps none"
    if rank == 1:  # as if rank 1 were in another pid namespace (container): it cannot see the others' tokens
        segment.peer_segment = lambda path, nbytes, token: None
    transport, reason = SharedMemoryTransport.create(dist.group.WORLD, SIZES)
    assert transport is None and "cannot map the others' memory" in reason


def _check_summon_more_units_than_slots(rank: int, world_size: int) -> None:
    """summon_full_params gathers every unit before reading any: more collectives in flight than slots. The
    transport is created at a first forward under inference mode and still written by training afterwards."""
    config = GPTConfig(vocab_size=61, block_size=8, n_layer=GATHERS + 2, n_head=2, n_embd=8)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1))
    with torch.inference_mode():  # the first forward creates the transport; under Lightning it can be validation's
        model(tokens[:, :-1], tokens[:, 1:])
    transport = units_under(model)[0].transport()
    assert isinstance(transport, SharedMemoryTransport)
    assert not any(segment.is_inference() for segment in transport.segments)
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # training writes into the slots outside inference mode
    with summon_full_params(model):
        for (name, full), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            assert torch.equal(full, expected), name


def _check_a_large_root_streams_in_chunks(rank: int, world_size: int, stalled: bool, shared_memory: bool) -> None:
    """A language model's root holds its embedding and untied head (4093 rows each: padded shards) and chunks are
    bounded below a block's reduction: every collective still goes through shared memory, the larger ones in
    chunks, the segment stays five slots of the bound, and training equals the unsharded model's (see [Note:
    chunks] in ``transport/shm/slots.py``).
    ``stalled``: rank 1 is slow at every chunk it packs, so the others wait for its chunks and for its reads.
    Without ``shared_memory`` the same over gloo, whose large reductions go in chunks too (see [Note: chunks over
    gloo] in ``transport/gloo.py``) and whose gathers need no buffer at all (see [Note: gathers point to point])."""
    os.environ[CHUNK_SWITCH] = "0.01"  # 10485 bytes: a block's gather fits, its reduction and the root's do not
    os.environ[shm.ENV_SWITCH] = "1" if shared_memory else "0"
    config = GPTConfig(vocab_size=4093, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    if stalled and rank == 1:
        real_packs = {"pack_peer_rows": packing.pack_peer_rows, "pack_rows": packing.pack_rows}

        def slow_pack(*args: object) -> None:
            time.sleep(0.01)
            real_packs["pack_peer_rows" if len(args) > 3 else "pack_rows"](*args)

        packing.pack_peer_rows = slow_pack
        packing.pack_rows = slow_pack
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    counters = []
    for _ in range(2):
        for m, optimizer in zip((reference, model), optimizers, strict=True):
            with CollectiveCounter() if m is model else contextlib.nullcontext() as counter:
                m(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        counters.append(counter)
    with summon_full_params(model):
        for (name, full), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6, msg=name)
    units = units_under(model)
    root, blocks = units[0], units[1:]
    transport = root.transport()
    bound = chunk_limit()
    events = counters[-1].events
    if not shared_memory:
        assert isinstance(transport, GlooTransport) and not isinstance(transport, SharedMemoryTransport)
        all_to_all = sum(event.kind == "all_to_all" for event in events)
        assert all_to_all > len(units) + 8, "every block's reduction in two chunks or more, the root's in many"
        reductions = [event for event in events if event.kind == "all_to_all"]
        assert max(event.bytes for event in reductions) <= bound, "no reduction moves more than a chunk at once"
        gathered = {e.numel for e in events if e.op == "gloo::point_to_point_all_gather"}
        assert root.send_bytes()["all_gather"] // 4 in gathered, "a gather is messages into the rows, announced whole"
        del os.environ[CHUNK_SWITCH], os.environ[shm.ENV_SWITCH]
        return
    assert isinstance(transport, SharedMemoryTransport)
    slot = -(-bound // 64) * 64
    assert {kind: slots.slot_bytes for kind, slots in transport.slots.items()} == {"all_gather": slot, "reduce": slot}
    assert max(unit.send_bytes()["all_gather"] for unit in blocks) <= slot < blocks[0].send_bytes()["reduce_scatter"]
    assert root.send_bytes()["all_gather"] > 8 * bound, "the root's gather takes many chunks"
    assert transport.homes.starts[0] == 64 + 5 * (64 + slot), "the rank's header and five slots, whatever the root"
    shards = [p.layout.shard_numel * 4 for unit in units for p in unit.params]
    assert [size for sizes in transport.homes.shards for size in sizes] == shards, "then every unit's shards"
    assert (
        transport.resident_bytes
        == transport.homes.end
        < transport.homes.starts[0] + sum(shards) + 4096 * (len(shards) + 1)
    ), "each shard from a page of its own"
    assert [e.op for e in events if not e.op.startswith("shm::")] == [], "nothing over gloo"
    ops = [e.op for e in events]
    assert ops.count("shm::reduce_scatter") == len(units), ops
    gathered = {e.numel for e in events if e.op == "shm::all_gather"}
    assert root.send_bytes()["all_gather"] // 4 in gathered, "a chunked collective is announced once, whole"
    del os.environ[CHUNK_SWITCH], os.environ[shm.ENV_SWITCH]


def _check_shards_live_at_home(rank: int, world_size: int) -> None:
    """See [Note: shards that live in shared memory]: after the first forward every unit's shards are views of this
    rank's segment and a gather packs nothing; SGD steps them there to the unsharded model's values; a shard whose
    ``.data`` was replaced is gathered from its new value; and a rank that writes its shards right after an evaluation
    forward does so only once the slowest peer has read them."""
    config = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=8, tie_weights=False)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    packed: list[int] = []
    real_pack = packing.pack

    def counted_pack(tensors: list[torch.Tensor], out: torch.Tensor, start: int = 0) -> None:
        packed.append(out.numel())
        real_pack(tensors, out, start)

    def train_step() -> None:
        for m, optimizer in zip((reference, model), optimizers, strict=True):
            m(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()

    train_step()
    transport = units_under(model)[0].transport()
    assert isinstance(transport, SharedMemoryTransport)
    for unit, unit_homes in zip(units_under(model), transport.home_shards, strict=True):
        for fsdp_param, home in zip(unit.params, unit_homes, strict=True):
            name = fsdp_param.fqn
            assert fsdp_param.sharded.data_ptr() == home.data_ptr(), f"{name} lives in this rank's segment"
            padded = fsdp_param.layout.shard_numel * 4
            assert fsdp_param.sharded.untyped_storage().nbytes() == padded, f"{name}: a storage of its own"
    packing.pack = counted_pack
    try:
        train_step()
    finally:
        packing.pack = real_pack
    assert packed == [], "no gather packed its shards"
    assert _open_segment_descriptors() == [], "mapping the shards left no descriptor open"
    block = units_under(model)[1].params[0]
    with torch.no_grad():  # a user's new tensor for one shard, and the same change to the unsharded model
        block.sharded.data = block.sharded.detach() * 2
        reference.get_parameter(block.fqn).mul_(2)
    train_step()
    with summon_full_params(model):
        for (name, full), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6, msg=name)

    if rank == 1:  # this rank reads the others' shards long after they published them
        real_unpack = packing.unpack_all_gather

        def slow_unpack(*args: object) -> None:
            time.sleep(0.3)
            real_unpack(*args)

        packing.unpack_all_gather = slow_unpack
    with torch.no_grad():
        expected_loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss = model(tokens[:, :-1], tokens[:, 1:])
        for m in (reference, model):  # written at once on the ranks that finished first
            for param in m.parameters():
                param.add_(1.0)
    if rank == 1:
        packing.unpack_all_gather = real_unpack
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)


def test_shards_live_in_shared_memory_and_are_written_only_once_read() -> None:
    run_distributed(_check_shards_live_at_home, 2)


def _check_homes_are_given_up_together(rank: int, world_size: int) -> None:
    """When the kernel refuses one rank a shard's mapping (its limit on a process's mappings), or a model has more
    shards than homes are made for, every rank keeps its shards where they were and gathers through the slots of the
    same shared memory, with the unsharded model's results."""
    config = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=8)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    real_map, real_most = segment.map_range, homes.MAX_HOMED_SHARDS

    def refused(fd: int, offset: int, nbytes: int) -> torch.Tensor:
        raise OSError(errno.ENOMEM, "the kernel's limit on mappings")

    for why in ("one rank refused", "too many shards"):
        if why == "one rank refused" and rank == 1:
            segment.map_range = refused
        if why == "too many shards":
            homes.MAX_HOMED_SHARDS = 3
        try:
            torch.manual_seed(0)
            reference = GPT(config)
            torch.manual_seed(0)
            model = fully_shard(GPT(config), {Block})
            for m in (reference, model):
                m(tokens[:, :-1], tokens[:, 1:]).backward()
        finally:
            segment.map_range, homes.MAX_HOMED_SHARDS = real_map, real_most
        transport = units_under(model)[0].transport()
        assert isinstance(transport, SharedMemoryTransport), why
        assert transport.home_shards == [] and transport.homes.shards == (), why
        for unit in units_under(model):
            for fsdp_param in unit.params:
                grad = fsdp_param.sharded.grad
                expected = fsdp_param.layout.local_rows_of(reference.get_parameter(fsdp_param.fqn).grad)
                torch.testing.assert_close(grad.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6, msg=why)


def test_homes_are_given_up_on_every_rank_together() -> None:
    run_distributed(_check_homes_are_given_up_together, 2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_slots_are_agreed_and_fall_back_to_gloo_when_all_are_in_flight(world_size: int) -> None:
    run_distributed(_check_slots, world_size)


def test_a_slot_is_rewritten_only_after_every_rank_has_read_it() -> None:
    run_distributed(_check_no_rewrite_before_everyone_read, 2)


def test_every_rank_falls_back_to_gloo_together() -> None:
    run_distributed(_check_every_rank_agrees_to_fall_back, 2)


@pytest.mark.parametrize(
    ("world_size", "stalled", "shared_memory"), [(2, False, True), (2, True, True), (3, False, True), (2, True, False)]
)
def test_a_large_root_streams_in_chunks(world_size: int, stalled: bool, shared_memory: bool) -> None:
    run_distributed(_check_a_large_root_streams_in_chunks, world_size, stalled, shared_memory)


def test_summon_full_params_with_more_units_than_slots() -> None:
    run_distributed(_check_summon_more_units_than_slots, 2)


def _die_during_first_forward(rank: int, world_size: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, str(rank)), "w") as file:
        file.write(str(os.getpid()))
    config = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, n_embd=8)
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    if rank == 1:  # killed after reserving its segment, before any other rank could map it
        real_peer = segment.peer_segment

        def killed_while_mapping(path: str, nbytes: int, token: bytes) -> torch.Tensor | None:
            os.kill(os.getpid(), signal.SIGKILL)
            return real_peer(path, nbytes, token)

        segment.peer_segment = killed_while_mapping
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1))
    model(tokens[:, :-1], tokens[:, 1:])


def test_a_rank_killed_during_its_first_forward_leaves_nothing_in_dev_shm(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 of 2 died: killed by signal SIGKILL"):
        run_distributed(_die_during_first_forward, 2, str(tmp_path), timeout=60.0)
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert _dev_shm_entries_of(pids) == [], "no segment of the crashed run outlives it"


def _exit_quietly_before_the_first_gather(rank: int, world_size: int) -> None:
    transport = _create()
    assert transport is not None
    if rank == 1:  # gone without an error of its own: nothing but its absence tells rank 0
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(PeerExitedError, match=r"rank 1 \(pid \d+\) exited while this rank waited for it"):
        _gather(1.0, transport).wait()
    assert time.monotonic() - start < 10.0, "noticed within seconds, not at the process group's timeout"
    raise RuntimeError("rank 0 saw its peer exit")  # the only way out that the test can tell from a hang


def _exit_quietly_between_chunks(rank: int, world_size: int) -> None:
    """A gather of 63 slots' worth: rank 1 leaves after packing its third chunk, rank 0 waits for the fourth."""
    os.environ[CHUNK_SWITCH] = "0.00003"  # 31 bytes: 64-byte slots, 16 fp32 elements per chunk
    transport = _create()
    assert transport is not None and transport.slots["all_gather"].slot_bytes == 64
    if rank == 1:
        real_pack, packed = packing.pack, []

        def pack_then_exit(*args: object) -> None:
            real_pack(*args)
            packed.append(True)
            if len(packed) == 3:
                os._exit(0)

        packing.pack = pack_then_exit
    start = time.monotonic()
    with pytest.raises(PeerExitedError, match=r"rank 1 \(pid \d+\) exited while this rank waited for it"):
        transport.all_gather([torch.arange(1000.0)], torch.float32, None).wait()
    assert time.monotonic() - start < 10.0, "noticed within seconds, at the chunk it waited for"
    raise RuntimeError("rank 0 saw its peer exit between chunks")


def test_a_rank_that_exits_between_chunks_is_named_by_the_one_waiting_for_it() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 0 of 2 raised.*rank 0 saw its peer exit between chunks"):
        run_distributed(_exit_quietly_between_chunks, 2, timeout=60.0)


def test_a_rank_that_exits_mid_collective_is_named_by_the_one_waiting_for_it() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 0 of 2 raised.*rank 0 saw its peer exit"):
        run_distributed(_exit_quietly_before_the_first_gather, 2, timeout=60.0)


def test_waiting_on_counters_names_an_exited_or_zombie_peer_and_times_out() -> None:
    never = lambda: False  # noqa: E731
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while peer_wait.process_alive(child.pid):  # exited and not reaped yet: a zombie counts as gone
        time.sleep(0.01)
    with pytest.raises(PeerExitedError, match=f"rank 3 \\(pid {child.pid}\\) exited while this rank waited for it"):
        peer_wait.wait_until(never, {3: child.pid}, "a test", timeout_s=60.0)
    child.wait()
    with pytest.raises(TimeoutError, match=r"Timed out after 1 s waiting for ranks \[5\] in a test"):
        peer_wait.wait_until(never, {5: os.getpid()}, "a test", timeout_s=1.0)
    flips = iter([False] * 50 + [True])
    peer_wait.wait_until(lambda: next(flips), {5: os.getpid()}, "a test", timeout_s=1.0)  # returns once ready
