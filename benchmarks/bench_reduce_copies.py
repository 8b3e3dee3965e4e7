"""The copies of one reduce-scatter through shared memory, before and after the own row stayed in the gradients.

    python benchmarks/bench_reduce_copies.py                       # the 27.4M GPT's block (n_embd 672), W = 2
    python benchmarks/bench_reduce_copies.py --n-embd 512 --world-size 4 --repeats 50

One process, one thread, no communication: the peers' buffers are random memory of the slot's size, because what is
measured is only the memory traffic a rank pays for its own reduction, which does not depend on what the peers
wrote. "packed" is the engine before: every row of the gradients packed into the slot (``pack_rows``), this rank's
row summed from every rank's slot (``sum_rows``), and the fp32 average divided in a pass of its own. "own row" is
the engine now (see [Note: the own row stays in the gradient] in ``lightning_fsdp/engine/packing.py``): only
the peers' rows packed, the division folded into that copy and into the sum, the own row read from the gradients.
Rounds alternate the two, and each prints its median over ``--repeats`` reductions; the two results are checked
equal first (bit for bit when the world size is a power of two).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.packing import RankRows


def block_gradients(n_embd: int, world_size: int) -> list[RankRows]:
    """The weight gradients of one demo GPT block (attention in and out, MLP in and out), flat, with the columns each
    rank receives (dim 0 padded to a multiple of the world size, as ``ShardLayout`` does)."""
    shapes = [(3 * n_embd, n_embd), (n_embd, n_embd), (4 * n_embd, n_embd), (n_embd, 4 * n_embd)]
    grads = []
    for rows, row_numel in shapes:
        columns = -(-rows // world_size) * row_numel
        grads.append(RankRows(torch.randn(rows * row_numel), columns))
    return grads


def reductions(grads: list[RankRows], world_size: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The two ways of rank 0's reduction; the peers' slots hold what each way has the peers pack."""
    columns = sum(grad.columns for grad in grads)
    mine = torch.empty(world_size, columns)  # this rank's slot
    peers_packed = [torch.randn(world_size, columns) for _ in range(world_size - 1)]
    # The engine folds the division into the copies for a power-of-two world size only (exact there), and else
    # divides the result, as before.
    folds = world_size & (world_size - 1) == 0
    scale = 1.0 / world_size if folds else 1.0
    peers_divided = [peer * scale for peer in peers_packed]  # as pack_peer_rows leaves them
    rank = 0

    def packed() -> torch.Tensor:
        packing.pack_rows(grads, mine)
        result = packing.sum_rows([slot[rank] for slot in (mine, *peers_packed)])
        return result.div_(world_size)

    def own_row() -> torch.Tensor:
        packing.pack_peer_rows(grads, mine, rank, scale)
        result = torch.empty(columns)
        packing.sum_own_row(grads, rank, [peer[rank] for peer in peers_divided], scale, result)
        return result if folds else result.div_(world_size)

    return {"packed": packed, "own row": own_row}


def median_ms(run: Callable[[], torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, default=672)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    grads = block_gradients(args.n_embd, args.world_size)
    runs = reductions(grads, args.world_size)
    numel = sum(grad.flat.numel() for grad in grads)
    print(f"one block's gradients: {numel / 1e6:.2f}M fp32 elements ({numel * 4 / 2**20:.1f} MiB), W={args.world_size}")
    results = [run() for run in runs.values()]  # also warms the slot's memory
    exact = args.world_size & (args.world_size - 1) == 0  # a power of two divides without rounding
    same = torch.equal(*results) if exact else torch.allclose(*results, rtol=1e-6, atol=1e-6)
    if not same:
        raise SystemExit("the two reductions disagree")
    print(f"  both reductions give the same result ({'bit for bit' if exact else 'to 1e-6'})")
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, run in runs.items():
            medians[name].append(median_ms(run, args.repeats))
        cells = ", ".join(f"{name} {values[-1]:.2f} ms" for name, values in medians.items())
        print(f"round {round_index + 1}: {cells}")
    before, after = statistics.median(medians["packed"]), statistics.median(medians["own row"])
    print(f"median of rounds: packed {before:.2f} ms, own row {after:.2f} ms, ratio {after / before:.2f}")


if __name__ == "__main__":
    main()
