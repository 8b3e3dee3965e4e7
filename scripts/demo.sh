#!/usr/bin/env bash
# Trains the demo GPT with fully_shard on 2 CPU processes (arguments go to examples/train_gpt.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# Two ranks share this machine's cores: one thread each keeps them from oversubscribing it.
OMP_NUM_THREADS=1 exec .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py "$@"
