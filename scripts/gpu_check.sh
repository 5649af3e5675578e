#!/usr/bin/env bash
# On the GPU machine (two H200s): every GPU test, then the benchmarks behind the README's GPU
# figures. Outputs go to $OUT (default ./out). greenlet is installed from .whl/ when the image
# lacks it (see README: "Tests"). GPU_CHECK_PARTS picks parts (default: all, in this order).
# GPU_CHECK_PACK=1 packs every output into one $OUT/gpu_check.tar.gz at the end (for a machine
# that hands back only a few files). The machine's copy of the tree has no git history: run it as
# UBATCH_CODE_VERSION=<commit> bash scripts/gpu_check.sh so every report names the code it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
parts=${GPU_CHECK_PARTS:-tests link modes modes_prefill modes_tp modes_fused sm sm_slow prefill prefill_green prefill_graphs balanced mixed dense decode comm_waits first_use spec generate}  # flash_stage, flash, expert_gemm, modes_prefill_sweeps (the prefill sweeps alone), modes_w8, modes_w8_prefill, decode_kernel, decode_kernel_w8, glue_kernels, router, targets, grouped_gemm, proxy, proxy_more: on request
want() { [[ " $parts " == *" $1 "* ]]; }
# flash-attn 4, staged by scripts/stage_flash_attn4.sh: flash_stage alone in one call (carrying
# only .fa4a, so before anything needs .whl), the rest in the call right after
if want flash_stage; then
  cp .fa4a/site.tar.xz.part-aa /tmp/ && ls -la /tmp/site.tar.xz.part-aa
  [ "$parts" = flash_stage ] && exit 0
fi
if ! python3 -c "import greenlet" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# flash-attn 4 (scripts/stage_flash_attn4.sh): its first piece copied to /tmp by the flash_stage
# part of the call before, its second carried in .fa4b/ now; every part below then runs with it
# (--attention auto takes it).
if [ -f /tmp/site.tar.xz.part-aa ] && compgen -G ".fa4b/site.tar.xz.part-*" >/dev/null; then
  if [ ! -d /tmp/fa4site ]; then
    mkdir -p /tmp/fa4site && cat /tmp/site.tar.xz.part-aa .fa4b/site.tar.xz.part-* | xz -d | tar -x -C /tmp/fa4site || exit 1
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages  # the DSL's .pth, by hand
fi
run2() { timeout "$1" python3 -m torch.distributed.run --nproc-per-node 2 "${@:2}" 2>&1 \
  | grep -vE "configurations:|OMP_NUM_THREADS|^\*+$|carveout for matmuls"; }
slow() { NCCL_MAX_NCHANNELS=1 NCCL_P2P_DISABLE=1 "$@"; }
run1() { timeout "$1" python3 "${@:2}" 2>&1 | grep -vE "configurations:|Capturing|UserWarning|_warn_once"; }

nvidia-smi -L
want tests && timeout 480 python3 -m pytest -q -m "cuda or multigpu" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
want sm && run2 150 scripts/bench_sm.py --modes none,green,cooperative --comm-sms 16,32 --repeats 3 --out "$OUT/sm_h200x2.json" | tail -22
# how much a GEMM loop stretches the slow link's all-to-all (and an SM copy), away from the model
want sm_slow && slow run2 150 scripts/bench_sm.py --comm copy,all_to_all --modes none,green --comm-sms 16 --repeats 5 --out "$OUT/sm_h200x2_slowlink.json" | tail -6
prefill="-m ubatch.bench --model moe --prompt-len 512 --policy auto"
if want prefill; then  # eager, no SM partition
  run2 150 $prefill --tokens 256,1024,4096 --num-ubatches 2,3 --out "$OUT/moe_prefill_nvlink.json" --plot "$OUT/moe_prefill_nvlink.png" --label nvlink | tail -12
  slow run2 150 $prefill --tokens 1024,4096 --num-ubatches 2,3 --out "$OUT/moe_prefill_slowlink.json" --plot "$OUT/moe_prefill_slowlink.png" --label slow-link | tail -10
fi
want prefill_green && slow run2 150 $prefill --tokens 1024,4096 --num-ubatches 2,3 --sm-partition green --out "$OUT/moe_prefill_slowlink_green.json" --plot "$OUT/moe_prefill_slowlink_green.png" --label slow-link-green | tail -10
if want prefill_graphs; then  # PIECEWISE graph replays, green partition
  slow run2 200 $prefill --graphs --sm-partition green --tokens 1024,2048,4096 --num-ubatches 2,3 --out "$OUT/moe_prefill_graphs_slowlink_green.json" --label slow-link-graphs-green | tail -10
  run2 150 $prefill --graphs --sm-partition green --tokens 1024,4096 --num-ubatches 2 --out "$OUT/moe_prefill_graphs_nvlink_green.json" --label nvlink-graphs-green | tail -6
fi
if want balanced; then  # capped all-to-all payloads: C close to M, where N=3/4 should pay (schedule model)
  slow run2 240 $prefill --graphs --sm-partition green --capacity-factor 1.25 --tokens 2048,4096 --num-ubatches 2,3,4 --out "$OUT/moe_prefill_graphs_slowlink_green_cf1.25.json" --label slow-link-graphs-green-cf1.25 | tail -12
fi
if want mixed; then  # a quarter decodes: the torch attention backend batches each run of equal query lengths
  slow run2 200 -m ubatch.bench --model moe --workload mixed --prompt-len 512 --context-len 512 --policy auto --tokens 1024,4096 --num-ubatches 2,3 --sm-partition green --out "$OUT/moe_mixed_slowlink_green.json" --label slow-link-mixed-green | tail -10
  slow run2 200 -m ubatch.bench --model moe --workload mixed --prompt-len 512 --context-len 512 --policy auto --graphs --tokens 1024,4096 --num-ubatches 2 --sm-partition green --out "$OUT/moe_mixed_graphs_slowlink_green.json" --label slow-link-mixed-graphs-green | tail -8
fi
if want dense; then  # TP dense prefill: two all-reduces per layer, replayed from PIECEWISE graphs, green
  dense="-m ubatch.bench --model dense --prompt-len 512 --policy auto --graphs --sm-partition green --tokens 1024,4096 --num-ubatches 2,3"
  run2 200 $dense --out "$OUT/dense_tp_prefill_graphs_nvlink_green.json" --label nvlink-graphs-green | tail -8
  slow run2 200 $dense --out "$OUT/dense_tp_prefill_graphs_slowlink_green.json" --label slow-link-graphs-green | tail -8
fi
decode="-m ubatch.bench --model moe --workload decode --graphs --layers 4 --tokens 64,256,512,1024 --num-ubatches 2 --repeats 20 --policy auto --sm-partition green"
if want decode; then  # FULL graph replays, green partition
  slow run2 150 $decode --out "$OUT/moe_decode_graphs_slowlink_green.json" --label slow-link-graphs-green | tail -9
  run2 150 $decode --out "$OUT/moe_decode_graphs_nvlink_green.json" --label nvlink-graphs-green | tail -9
fi
if want first_use; then  # eager serving of staggered requests, one process per attention path (cuDNN plans are
  # per process) and repeat: identical processes spread widely, so the README reports medians
  for repeat in $(seq "${FIRST_USE_REPEATS:-3}"); do for attention in builtin_flash sdpa math; do for n in 1 2; do
    timeout 150 python3 scripts/first_use_cost.py --attention "$attention" --num-ubatches "$n" 2>&1 | tail -1 | tee -a "$OUT/first_use_cost_1gpu.jsonl"
  done; done; done
  python3 scripts/first_use_cost.py --summarize "$OUT/first_use_cost_1gpu.jsonl"
fi
if want comm_waits; then  # profiled graph replays of both ranks: NCCL time as transfer vs waiting for the peer
  mkdir -p "$OUT/profiles"
  for w in decode:256 decode:512 decode:1024 prefill:4096; do
    workload=${w%:*} tokens=${w#*:} tag=_${w/:/}_graphs_slowlink_green
    args=(--workload "$workload" --graphs --tokens "$tokens" --sm-partition green:16 --tag "$tag" --out "$OUT/profiles")
    [ "$workload" = decode ] && args+=(--layers 4 --num-ubatches 1,2) || args+=(--num-ubatches 1,2,3)
    slow run2 240 scripts/profile_step.py "${args[@]}" | grep '^{' | tee -a "$OUT/comm_waits.log"
    python3 scripts/comm_waits.py "$OUT"/profiles/profile${tag}_rank{0,1}.json.gz | tee -a "$OUT/comm_waits.log"
  done
  tar -C "$OUT" -cf "$OUT/profiles.tar" profiles && rm -r "$OUT/profiles"
fi
# 8 experts per call (unsplit, 8 local), 4 (a world of 2), 2 (its expert groups when pipelined), to 256 rows
want expert_gemm && timeout 200 python3 scripts/bench_expert_gemm.py --experts 8,4,2 --rows 16,32,64,128,192,256 \
  | tee "$OUT/expert_gemm.log"
if want link; then  # the link stand-in alone: its GPU tests, then what it reaches by payload size
  timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_link.py 2>&1 | tee "$OUT/gpu_link_tests.log" | tail -3
  timeout 120 python3 scripts/link_bandwidth.py --out "$OUT/link_bandwidth.json" 2>&1 | tee "$OUT/link_bandwidth.log" | tail -20
fi
# one H200: every overlap mode from graphs, no communication, then over the link stand-in paced so
# that communication is ~40-100% of the step's compute (docs/overlap-modes.md), with capacity
# factors measured from the routing (at 2.0 a pipelined mode's buckets, with fewer experts each,
# send more padding than one bucket of every expert); decode and prefill are separate parts, each
# well inside one 10-minute call
common="-m ubatch.bench --graphs --layers 4 --capacity-factor 2.0"
measured="-m ubatch.bench --graphs --layers 4 --capacity-factor measured"
split_modes="overlap,pipeline2,pipeline4,split2,split2+pipeline2"
if want modes; then
  decode_modes="$split_modes,split2+join,split2+join+pipeline2,split2+join+pipeline4,split2+local"
  mode_decode="$common --workload decode --tokens 256,1024 --modes"
  run1 150 $mode_decode $decode_modes --preset moe-bench --out "$OUT/modes_moe_decode_nocomm.json" | tail -30
  # what each mode adds, and where the unsplit 1024-token step (a third of its roofline) spends its time
  timeout 180 python3 scripts/mode_kernels.py --tokens 256,1024 --modes overlap,pipeline2,split2,split2+join --top 8 2>&1 \
    | grep -v -i warn | tee "$OUT/mode_kernels_moe_decode256_1024.log"
  link_decode="$measured --workload decode --tokens 256,1024 --modes $decode_modes"
  run1 180 $link_decode --preset moe-bench --link host:5 --out "$OUT/modes_moe_decode_link5.json" | tail -31
  run1 180 $link_decode --preset deepseek-bench --link host:5 --out "$OUT/modes_deepseek_decode_link5.json" | tail -31
fi
if want modes_prefill; then
  # what a prefill split adds (its cost without communication) and leaves exposed over the link
  for link in none host:12.5; do
    timeout 200 python3 scripts/mode_kernels.py --workload prefill --tokens 4096 --link "$link" \
      --modes pipeline2,pipeline4,split2,split3,split2+local --top 10 2>&1 | grep -v -i warn \
      | tee -a "$OUT/mode_kernels_moe_prefill4096.log"
  done
  # traces of where pipelining falls short of the schedule model and of what own rows first hides
  timeout 150 python3 scripts/mode_kernels.py --workload prefill --tokens 4096 --link host:12.5 --modes pipeline4,split2 \
    --trace-dir "$OUT/traces_prefill4096_link12.5" --top 0 2>&1 | grep -v -i warn | tail -3
fi
if want modes_prefill || want modes_prefill_sweeps; then
  mode_prefill="$measured --workload prefill --prompt-len 512 --tokens 4096 --modes $split_modes,split3,local,split2+local,split3+local"
  run1 180 $mode_prefill --preset moe-bench --link host:12.5 --out "$OUT/modes_moe_prefill_link12.5.json" | tail -14
  run1 300 $mode_prefill,split4 --preset deepseek-bench --link host:8 --out "$OUT/modes_deepseek_prefill_link8.json" | tail -16
fi
if want modes_tp; then  # tensor parallelism over the stand-in: chunked all-reduces against a split
  run1 150 -m ubatch.bench --graphs --layers 4 --model dense --preset dense-bench --workload prefill --prompt-len 512 \
    --tokens 4096 --modes overlap,allreduce2,allreduce4,split2,split2+allreduce2 --link host \
    --out "$OUT/modes_dense_prefill_link.json" | tail -10
  # over the stand-in even the plain split hid none of the all-reduces: where does it wait?
  timeout 150 python3 scripts/mode_kernels.py --preset dense-bench --workload prefill --tokens 4096 --link host \
    --modes split2,allreduce2 --trace-dir "$OUT/traces_dense_prefill4096_link" --top 8 2>&1 | grep -v -i warn \
    | tee "$OUT/mode_kernels_dense_prefill4096_link.log"
fi
if want kv_pages; then  # flash-attn 4 reads a page of its key tile (128 tokens) with TMA, a smaller one by gathering rows
  timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_attention.py tests/test_gpu_overlap_modes.py \
    tests/test_fusion.py 2>&1 | tee "$OUT/gpu_kv_pages_tests.log" | tail -3
  for pages in 16 128; do
    run1 150 $common --workload decode --tokens 256,1024 --modes overlap,pipeline2,split2,split2+join --preset moe-bench \
      --kv-block-size "$pages" --out "$OUT/modes_moe_decode_nocomm_kv$pages.json" | tail -12
  done
  timeout 150 python3 scripts/mode_kernels.py --tokens 256,1024 --modes split2 --top 6 2>&1 | grep -v -i warn \
    | tee "$OUT/mode_kernels_moe_decode256_1024_kv128.log"
  run1 150 $measured --workload decode --tokens 256,1024 --modes overlap,pipeline2,split2,split2+join --preset moe-bench \
    --link host:5 --out "$OUT/modes_moe_decode_link5_kv128.json" | tail -12
  run1 150 $measured --workload decode --tokens 256,1024 --modes overlap,pipeline2,pipeline4,split2,split2+join+pipeline2 \
    --preset deepseek-bench --link host:5 --out "$OUT/modes_deepseek_decode_link5_kv128.json" | tail -14
fi
if want modes_fused; then  # the decode sweeps with the glue compiled (--fuse-glue), and what each mode exposes
  fused="--fuse-glue --workload decode --tokens 256,1024"
  fused="$fused --modes overlap,pipeline2,pipeline4,split2,split2+join,split2+join+pipeline2,split2+join+pipeline4"
  run1 200 $common $fused --preset moe-bench --out "$OUT/modes_moe_decode_nocomm_fused.json" | tail -26
  run1 200 $measured $fused --preset moe-bench --link host:5 --out "$OUT/modes_moe_decode_link5_fused.json" | tail -26
  run1 200 $measured $fused --preset deepseek-bench --link host:5 --out "$OUT/modes_deepseek_decode_link5_fused.json" \
    | tail -26
  for preset in moe-bench deepseek-bench; do
    timeout 200 python3 scripts/mode_kernels.py --preset "$preset" --link host:5 --fuse-glue \
      --modes overlap,pipeline2,split2,split2+join,split2+join+pipeline2 --top 8 2>&1 | grep -v -i warn \
      | tee "$OUT/mode_kernels_${preset}_decode256_link5_fused.log"
  done
fi
ratio="python3 scripts/sweep_at_ratio.py --ratio 0.9 --world 8"
if want modes_w8; then  # the stand-in at world size 8 (a rank holds 1/8 of the experts), M / C 0.9
  decode="--graphs --layers 4 --capacity-factor measured --workload decode --tokens 256"
  timeout 150 $ratio --probe-gbps 14 --out "$OUT/modes_moe_decode256_w8.json" -- $decode --preset moe-bench \
    --modes overlap,split2,split3,split2+join,split3+join 2>&1 | tail -9
  timeout 170 $ratio --probe-gbps 24 --out "$OUT/modes_deepseek_decode256_w8.json" -- $decode --preset deepseek-bench \
    --modes overlap,pipeline2,split2,split3,split2+join,split2+join+pipeline2 2>&1 | tail -10
fi
if want modes_w8_prefill; then  # the same for prefill, a call of its own
  prefill="--graphs --layers 4 --capacity-factor measured --workload prefill --prompt-len 512 --tokens 4096"
  timeout 240 $ratio --probe-gbps 34 --out "$OUT/modes_moe_prefill4096_w8.json" -- $prefill --preset moe-bench \
    --modes overlap,split2,split3 2>&1 | tail -7
  timeout 270 $ratio --probe-gbps 40 --out "$OUT/modes_deepseek_prefill4096_w8.json" -- $prefill \
    --preset deepseek-bench --modes overlap,pipeline2,split2,split3 2>&1 | tail -8
fi
if want router; then  # the batch-invariant router kernels: their GPU test, then their cost against cuBLAS's float32 path
  timeout 90 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_router.py 2>&1 | tee "$OUT/gpu_router_tests.log" | tail -3
  timeout 60 python3 scripts/bench_router.py --rows 256,1024,4096 --experts 8,64 2>&1 | grep '^{' | tee "$OUT/router.log"
fi
if want targets; then  # the overlap-modes issue's points on one GPU as run 25 measured them, well inside one call:
  # 256-token decode as one rank of eight, 4096-token prefill with FULL graphs, and where decode's split goes
  decode="--graphs --layers 4 --capacity-factor measured --workload decode --tokens 256 --repeats 5"
  prefill="--graphs --prefill-graphs full --layers 4 --capacity-factor measured --workload prefill --prompt-len 512 --tokens 4096 --warmup 2 --repeats 3"
  run1 90 -m ubatch.bench $decode --preset deepseek-bench --link host::w8 --modes split2,split2+join+pipeline4,pipeline4 \
    --out "$OUT/targets_deepseek_decode256_w8.json" | grep -E "^ +256|auto"
  run1 90 -m ubatch.bench $decode --preset moe-bench --link host:22:w8 --modes split2,overlap \
    --out "$OUT/targets_moe_decode256_w8_22gbps.json" | grep -E "^ +256|auto"
  run1 150 -m ubatch.bench $prefill --preset deepseek-bench --link host::w4 --modes split4,split2+tokens2 \
    --out "$OUT/targets_deepseek_prefill4096_w4.json" | grep -E "^ +4096|auto"
  run1 150 -m ubatch.bench $prefill --preset moe-bench --link host:31:w8 --modes split2+tokens2,split4 \
    --out "$OUT/targets_moe_prefill4096_w8_31gbps.json" | grep -E "^ +4096|auto"
  timeout 80 python3 scripts/mode_kernels.py --preset deepseek-bench --tokens 256 --layers 4 --capacity-factor measured \
    --link host::w8 --modes split2 --top 25 2>&1 | grep -v -i warn | tee "$OUT/mode_kernels_deepseek_decode256_w8.log" | grep '^{'
fi
proxy_ratio="python3 scripts/sweep_at_ratio.py --kind proxy --ratio 0.95"
proxy_prefill="--graphs --prefill-graphs full --layers 4 --capacity-factor measured --workload prefill --prompt-len 512 --tokens 4096 --warmup 2 --repeats 3"
proxy_decode="--graphs --layers 4 --capacity-factor measured --workload decode --tokens 256 --repeats 5"
if want proxy; then  # the proxy-paced link: its tests, then the issue's four points in the regime only it
  # reaches (M / C 0.95, one rank of eight), the likeliest first; each sweep takes 1-2 minutes (run 27's over HostLink)
  # (the link's optional warp wait is left to proxy_more: a failure there must not cost these sweeps)
  timeout 120 python3 -m pytest -q --capture=sys -m cuda -p no:cacheprovider -k "not warp" tests/test_proxy_link.py \
    tests/test_link.py::test_cuda_graph_capture_and_replay tests/test_send_rows.py 2>&1 \
    | tee "$OUT/gpu_proxy_link_tests.log" | tail -3
  if grep -qE '[0-9]+ (failed|errors?)' "$OUT/gpu_proxy_link_tests.log"; then
    echo "proxy link tests failed: no sweeps over it"
  else
    timeout 150 $proxy_ratio --world 8 --probe-gbps 34 --out "$OUT/proxy_moe_prefill4096_w8_r095.json" -- $proxy_prefill \
      --preset moe-bench --modes split4,split2+tokens2,split4+tokens2 2>&1 | grep -E "^ +4096|reached|auto"
    # the joined stages (which now run the shared experts too) against unsplit on the GPU, before they are swept
    timeout 150 python3 -m pytest -q --capture=sys -m cuda -p no:cacheprovider -k joined_experts \
      tests/test_gpu_overlap_modes.py 2>&1 | tee "$OUT/gpu_joined_tests.log" | tail -3
    joined=",split3+join,split4+join,split2+join+pipeline4"
    grep -qE '[0-9]+ (failed|errors?)' "$OUT/gpu_joined_tests.log" && joined="" && echo "joined stages failed: not swept"
    timeout 120 $proxy_ratio --world 8 --probe-gbps 24 --out "$OUT/proxy_ds_decode256_w8_r095.json" -- $proxy_decode \
      --preset deepseek-bench --modes "split2$joined" 2>&1 | grep -E "^ +256|reached|auto"
    # as one rank of eight each expert takes 4096 rows, twice as many as in a world of four, so a
    # split's expert GEMMs lose less to part-empty tiles (a world the copy engines could not reach)
    timeout 150 $proxy_ratio --world 8 --probe-gbps 75 --out "$OUT/proxy_ds_prefill4096_w8_r095.json" -- $proxy_prefill \
      --preset deepseek-bench --modes split4,split3+tokens2,split4+tokens2 2>&1 | grep -E "^ +4096|reached|auto"
    timeout 90 $proxy_ratio --world 8 --probe-gbps 20 --out "$OUT/proxy_moe_decode256_w8_r095.json" -- $proxy_decode \
      --preset moe-bench --modes "split2${joined%,split2+join+pipeline4}" 2>&1 | grep -E "^ +256|reached|auto"
  fi
fi
if want proxy_more; then  # after proxy: the link's warp wait, what a ubatch and an expert group cost today over the
  # link, kernel by kernel (the joined stages need both cut; the link waits in a warp there, so the trace shows its
  # transfers), and deepseek-bench prefill as one rank of four (runs 24-27's world)
  timeout 60 python3 -m pytest -q --capture=sys -m cuda -p no:cacheprovider -k warp tests/test_proxy_link.py 2>&1 \
    | tee "$OUT/gpu_proxy_link_warp_tests.log" | tail -3
  timeout 100 python3 scripts/mode_kernels.py --preset deepseek-bench --tokens 256 --layers 4 --capacity-factor measured \
    --link proxy:24:w8:warp --modes split2,split2+join+pipeline4 --top 40 2>&1 | grep -v -i warn \
    | tee "$OUT/mode_kernels_proxy_ds_decode256_w8.log" | grep '^{'
  timeout 190 $proxy_ratio --world 4 --probe-gbps 45 --out "$OUT/proxy_ds_prefill4096_w4_r095.json" -- $proxy_prefill \
    --preset deepseek-bench --modes split4,split3+tokens2 2>&1 | grep -E "^ +4096|reached|auto"
fi
if want grouped_gemm; then  # a split's expert GEMMs over skewed rows: torch's grouped GEMM against the probe's
  # Triton one with 64- and 128-row tiles (deepseek-bench prefill as one rank of four: 16 experts, 512 / 2048 rows)
  timeout 90 python3 scripts/bench_expert_gemm.py --experts 16 --hidden 4096 --inter 2048 --rows 512,2048 --skew 0.35 \
    2>&1 | grep '^{' | tee "$OUT/expert_gemm_skewed.log"
  timeout 150 python3 scripts/probe_grouped_gemm.py --experts 16 --hidden 4096 --inter 2048 --rows 512,2048 --skew 0.35 \
    2>&1 | grep -v -i warn | tee "$OUT/probe_grouped_gemm.log"
fi
if want decode_kernel; then  # the Triton decode kernel (attention backend "triton") against flash-attn 4: its tests,
  # its timing, and the decode modes without communication through each (the queued columns: launches hidden)
  timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_decode_kernel.py tests/test_attention.py 2>&1 \
    | tee "$OUT/gpu_decode_kernel_tests.log" | tail -3
  timeout 90 python3 scripts/bench_decode_attention.py --requests 8,64,256,1024 2>&1 | grep '^{' | tee "$OUT/decode_attention.log"
  timeout 60 python3 scripts/bench_decode_attention.py --requests 64,256 --query-len 3 2>&1 | grep '^{' \
    | tee -a "$OUT/decode_attention.log"  # verifying two drafted tokens
  for attention in flash triton; do
    run1 150 $common --workload decode --tokens 256,1024 --modes overlap,pipeline2,split2 --preset moe-bench \
      --attention "$attention" --out "$OUT/modes_moe_decode_nocomm_$attention.json" | tail -9
  done
fi
if want glue_kernels; then  # the rotary and RMSNorm kernels (one each, on by default on CUDA): their tests, the
  # no-comm decode modes through the default backend (the roofline share), and what the 1024-token step still spends
  timeout 90 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_rotary.py tests/test_rms_norm.py 2>&1 \
    | tee "$OUT/gpu_glue_kernel_tests.log" | tail -3
  run1 150 $common --workload decode --tokens 256,1024 --modes overlap,pipeline2,split2 --preset moe-bench \
    --out "$OUT/modes_moe_decode_nocomm.json" | tail -9
  timeout 120 python3 scripts/mode_kernels.py --tokens 1024 --modes overlap --top 14 2>&1 | grep -v -i warn \
    | tee "$OUT/mode_kernels_moe_decode1024.log"
fi
if want decode_kernel_w8; then  # the same as one rank of eight, M / C 0.9, a call of its own
  for attention in flash triton; do
    timeout 170 $ratio --probe-gbps 19 --out "$OUT/modes_moe_decode256_w8_$attention.json" -- --graphs --layers 4 \
      --capacity-factor measured --workload decode --tokens 256 --preset moe-bench --attention "$attention" \
      --modes overlap,split2 2>&1 | tail -6
  done
  # where the world-8 split waits on its transfers (0.45 ms in run 16): its trace, packed (a call returns few files)
  timeout 150 python3 scripts/mode_kernels.py --tokens 256 --link host:19:w8 --capacity-factor measured --modes split2 \
    --attention triton --top 12 --trace-dir "$OUT/traces_w8" 2>&1 | grep -v -i warn | tee "$OUT/mode_kernels_w8_triton.log"
  tar -C "$OUT" -czf "$OUT/traces_w8.tar.gz" traces_w8 && rm -r "$OUT/traces_w8"
fi
if want flash; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -k "flash_backend or graph_replay_matches_eager" \
    tests/test_attention.py 2>&1 | tee "$OUT/gpu_flash_tests.log" | tail -8
  timeout 150 python3 benchmarks/h200x2/explore/flash_attn4_paged.py 2>&1 | tee "$OUT/flash_attn4_paged.log"
fi
want spec && timeout 240 python3 -m ubatch.bench --workload generate --graphs --model dense --requests 32 \
  --prompt-len 128 --max-new-tokens 64 --spec-k 2,4 --out "$OUT/spec_generate_1gpu.json" 2>&1 | tail -12
if want generate; then  # DP+EP serving, every step split, then only the steps a calibrated policy picks
  run2 120 scripts/torchrun_generate.py --model moe --num-ubatches 2 | tail -4 | tee "$OUT/torchrun_generate.log"
  run2 180 scripts/torchrun_generate.py --model moe --num-ubatches 2 --split-policy auto | tail -4 | tee -a "$OUT/torchrun_generate.log"
fi
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  tar -C "$OUT" -czf /tmp/gpu_check.tar.gz --exclude gpu_check.tar.gz . && find "$OUT" -mindepth 1 -delete \
    && mv /tmp/gpu_check.tar.gz "$OUT/"
fi
exit 0
