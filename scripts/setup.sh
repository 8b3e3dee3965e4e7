# Idempotent set-up shared by scripts/demo.sh and scripts/test.sh (sourced, not run): after it, .venv in the
# repository root has torch and this package installed in editable mode, and the shell is in the repo root.
# A second run costs two Python start-ups: each step checks first whether it is already done.
#
# Environment:
#   LFSDP_TORCH_SPEC  the pip arguments that install torch on a machine without a GPU (default
#                     "torch==2.13.0"; on this project's machines a CPU wheel of it lies on disk). Elsewhere,
#                     add pip options, e.g. an --index-url that serves CPU-only builds of torch.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    if command -v python3.11 >/dev/null 2>&1; then
        python3.11 -m venv .venv
    else
        python3 -m venv .venv
    fi
fi

# torch first and on its own: the right build depends on the machine, and `pip install -e .` would
# otherwise pull whatever build the index offers first.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        echo "setup: installing torch (CUDA build)" >&2
        .venv/bin/python -m pip install -q torch
    else
        read -r -a torch_spec <<< "${LFSDP_TORCH_SPEC:-torch==2.13.0}"
        echo "setup: installing ${torch_spec[*]} (no GPU found)" >&2
        .venv/bin/python -m pip install -q "${torch_spec[@]}"
    fi
fi

# The stamp records when the dependencies were last installed, so an edit of pyproject.toml re-installs.
stamp=.venv/.lightning_fsdp-installed
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('lightning_fsdp')" >/dev/null 2>&1 \
    || [ ! -e "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing lightning_fsdp and its dependencies into .venv" >&2
    .venv/bin/python -m pip install -q -e ".[dev]"
    # The tests run LitGPT's own scripts on our strategy. LitGPT 0.5.13 pins jsonargparse<=4.41 and
    # huggingface-hub<1.4, which would downgrade transformers and jsonargparse for every other test; its code runs
    # on the versions installed above (everything else it imports is already there), so it comes without them.
    .venv/bin/python -m pip install -q --no-deps "litgpt==0.5.13"
    touch "$stamp"
fi
