#!/usr/bin/env bash
# On the GPU machine (two H200s): the GPU tests, then the EP MoE benchmark in both NCCL regimes.
# Logs, reports and timelines go to $OUT (default ./out). greenlet is installed from .whl/ when
# the image lacks it (see README: "Running on the GPU machine").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if ! python3 -c "import greenlet" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 300 python3 -m pytest -q -m "cuda or multigpu" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

bench() {  # name, extra args...
  local name=$1; shift
  timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 -m ubatch.bench --model moe \
    --prompt-len 512 --out "$OUT/$name.json" --plot "$OUT/$name.png" --label "$name" "$@" 2>&1 \
    | grep -v "configurations:" | tee -a "$OUT/bench.log" | tail -12
}
bench moe_prefill_nvlink --tokens 256,1024,4096 --num-ubatches 2,3
NCCL_MAX_NCHANNELS=1 NCCL_P2P_DISABLE=1 bench moe_prefill_slowlink --tokens 256,1024,4096 --num-ubatches 2,3
