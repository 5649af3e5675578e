#!/usr/bin/env bash
# Install ubatch (editable) with the extras named in $1 (e.g. "test"), without pulling a
# multi-GB CUDA build of torch onto a machine that has no GPU.
#   torch already importable -> kept as it is
#   an NVIDIA GPU present     -> torch from PyPI (CUDA build)
#   otherwise                 -> the CPU build (UBATCH_TORCH_CPU, default torch==2.13.0+cpu,
#                                from PyTorch's CPU index or a local wheel that pip finds)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
pip_install() { python3 -m pip install --disable-pip-version-check -q "$@"; }

if python3 -c "import torch" 2>/dev/null; then
  echo "install: keeping torch $(python3 -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip_install "torch>=2.11"
else
  pip_install --retries 1 "${UBATCH_TORCH_CPU:-torch==2.13.0+cpu}" --extra-index-url https://download.pytorch.org/whl/cpu
fi
pip_install -e ".${extras:+[$extras]}"
