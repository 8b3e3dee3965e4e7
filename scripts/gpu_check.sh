#!/usr/bin/env bash
# The CUDA checks in one go, in under 8 minutes on one GPU (the timeouts below bound it at 7.7): every test marked
# `cuda` (tests/cuda), then benchmarks/bench_gpu.py (ours vs torch FSDP2 vs the plain module, bf16, a 1.1B
# Llama-style model at W=1, with peak memory), and ONE summary table (markdown) on stdout. Exits nonzero when a
# test fails, when the benchmark fails or its implementations disagree, or when torch sees no GPU (a CPU build of
# torch in .venv included).
#
#   scripts/gpu_check.sh            # on a GPU machine; sets up .venv as scripts/setup.sh does (a CUDA torch
#                                   # where nvidia-smi works)
#   scripts/gpu_check.sh --smoke    # anywhere: the same steps on the CPU (the cuda tests skip, a tiny Llama over
#                                   # gloo), to check that the script and its table work
#
# Environment: PYTHON=/path/to/python uses that interpreter and skips the set-up.
set -euo pipefail

mode=gpu
case "${1:-}" in
    "") ;;
    --smoke) mode=smoke ;;
    *) echo "gpu_check: unknown argument '$1'; use no argument (GPU) or --smoke (CPU)" >&2; exit 2 ;;
esac

if [ -z "${PYTHON:-}" ]; then
    source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"  # leaves the shell in the repository root
    PYTHON=.venv/bin/python
else
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
fi

if [ "$mode" = gpu ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees no CUDA device." \
        "On a GPU machine, install a CUDA build of torch into .venv (or delete .venv and rerun);" \
        "elsewhere run scripts/gpu_check.sh --smoke." >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
status=0

# The tests first; their result goes into the table, and a failure makes the whole check fail at the end.
echo "gpu_check: tests marked cuda" >&2
timeout 200 "$PYTHON" -m pytest tests/cuda -m cuda -q -rs -p no:cacheprovider --junitxml "$work/cuda.xml" >&2 \
    || status=$?
if [ ! -s "$work/cuda.xml" ]; then
    echo "gpu_check: pytest wrote no report (status $status)" >&2
    exit 1
fi

echo "gpu_check: benchmark" >&2
bench_args=(--junit "$work/cuda.xml")
[ "$mode" = smoke ] && bench_args+=(--smoke)
timeout 260 "$PYTHON" benchmarks/bench_gpu.py "${bench_args[@]}" || status=$?

echo "gpu_check: $((SECONDS - started)) s in all, exit status $status" >&2
exit "$status"
