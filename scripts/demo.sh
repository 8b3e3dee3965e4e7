#!/usr/bin/env bash
# Trains the demo GPT with the myfsdp strategy on 2 CPU processes: `lightning-fsdp fit --config configs/demo.yaml`.
# It ends by printing where the checkpoint, the logs and the run's HTML report (FSDPMonitor's records) are.
# Arguments are appended to that command line (e.g. --trainer.max_steps 50 --model.n_layer 2).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# Two ranks share this machine's cores: one thread each keeps them from oversubscribing it.
OMP_NUM_THREADS=1 exec .venv/bin/lightning-fsdp fit --config configs/demo.yaml "$@"
