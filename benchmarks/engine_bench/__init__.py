"""Our FSDP engine against torch's FSDP2 and DDP: step time, memory, communication and loss, on one machine.

    python benchmarks/bench_engine.py                        # 2 gloo ranks, 1 thread each, fp32, ~25M params
    python benchmarks/bench_engine.py --preset tiny          # seconds, for a smoke test
    python benchmarks/bench_engine.py --impls fsdp2,ddp --json benchmarks/results/run.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_engine.py   # same, under torchrun
    python benchmarks/bench_engine.py --world-size 1 --impls ours,plain   # one rank: ours against the module itself
    python benchmarks/bench_engine.py --preset tiny --compile inductor   # every implementation torch.compile'd alike
    python benchmarks/bench_engine.py --compiled-row inductor   # also every implementation compiled, same rounds
    python benchmarks/bench_engine.py --transport gloo      # ours without shared memory, as between hosts
    python benchmarks/bench_engine.py --largest --batch-size 1 --json benchmarks/results/largest.json
    python benchmarks/bench_engine.py --from-json benchmarks/results/run.json benchmarks/results/largest.json \
        --plot benchmarks/plot.png                        # re-print and draw saved runs, without running

Why it is built this way:

- The same demo GPT, seed, data (each rank its own batches from the stdlib corpus), optimizer (AdamW, foreach)
  and gradient clipping run under each implementation, so the only difference is the parallelism. The final
  losses must agree; a disagreement is printed as a WARNING line because it means one of them is wrong.
- Implementations are interleaved round by round (ours, fsdp2, ddp, ours, fsdp2, ddp, ...): the machine is
  shared, and noise that comes and goes then hits all of them alike instead of whichever ran during it.
- Without torchrun, each (round, implementation) runs in fresh processes, forked from a server that imported
  torch once (``lightning_fsdp.runtime.launch``). ``ru_maxrss`` is a process-lifetime peak, so only a fresh process
  gives each implementation its own peak; all of them start from the server's memory, which the baseline row removes.
  Under torchrun all of them share the processes and the reported peak RSS is the running peak (marked "not
  isolated").
- Step time is per step the slowest rank's wall time (collectives make the ranks wait for each other anyway),
  and the median over all timed steps of all rounds.
- Memory is counted, not sampled: after a step (gradients still alive), the distinct storages behind the
  parameters, gradients and optimizer state, so a shard stored inside a padded buffer counts the buffer, and
  a freed (resized to 0) unsharded parameter counts nothing. DTensors (FSDP2) count their local tensors. The
  "live tensors" figure is the same over every tensor the garbage collector can reach, which catches buffers
  an engine keeps alive outside the parameters, plus this rank's own shared-memory segment of ours (allocated
  whole when the transport is created; its size in ``/proc/self/maps``, so no engine internals are needed).
- Communication volume is counted with ``CollectiveCounter`` (lightning_fsdp/engine/transport/comm_stats.py) on one
  extra step that is not timed, because its dispatch mode slows every operator.
- Communication time comes from ``torch.profiler`` on one more untimed step: "comm busy" is the union of the
  intervals in which the backend (gloo's worker threads) runs a collective; "comm exposed" is the part of it
  during which the training thread runs no compute operator. The latter is an upper bound on waiting: Python
  work between operators (hooks, bookkeeping) also counts as exposed. The same rule applies to all three.
- ``--largest`` turns the paper's "significantly larger models" into one number: at a fixed per-rank budget (by
  default what DDP's parameters, gradients and optimizer state measure on the chosen model), the largest model
  each strategy fits according to ``lightning_fsdp.estimate``, and one measured step of a model that the estimator
  says fits FULL_SHARD but not DDP. Its peak is measured too (allocator events under ``torch.profiler``), because
  the steady bytes after a step leave out the units gathered during it.
- ``--compiled-row BACKEND`` runs each implementation a second time per round under ``torch.compile(model,
  backend=BACKEND)`` (after it is parallelised, as users write it) and adds the compiled table, its ratios, the
  graph breaks and graphs compiled (``torch._dynamo``'s counters, read after the timed steps), and each
  implementation's compiled/eager step time. Compiling happens in the warm-up steps, outside the timing.
- ``--transport gloo`` sets ``LIGHTNING_FSDP_SHARED_MEMORY=0`` in every rank (of every implementation alike), so
  ours moves everything over gloo as it does between hosts; ``shm`` (the default) leaves one host's shared memory on.
- ``--plot`` draws step time, memory per implementation and memory against model size (the estimator's lines
  with the measured points on them) into one PNG, from the same payload ``--json`` writes, so a saved run can
  be drawn again with ``--from-json``; several comparisons (a gloo and a shm run) get a row each.

The code: ``config`` (options), ``trainees`` (the model under each implementation), ``measure`` (one rank's round),
``launch`` (rounds in spawned ranks or under torchrun), ``report`` (summaries and tables), ``largest`` (--largest),
``plots`` (--plot), ``main`` (the command line); ``benchmarks/bench_engine.py`` runs ``main``.
"""
