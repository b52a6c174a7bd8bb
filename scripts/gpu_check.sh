#!/usr/bin/env bash
# Everything the GPU machine checks, in one script (PIPELINE.md §8): the kernel tests for real
# (tests/test_kernels.py and test_topk_kernel.py on CUDA, the gpu-marked tests, among them the AOT
# kernels run as TensorRT runs them), the AOT compile of every plugin kernel for the flash sizes,
# and the microbenchmarks (AOT against JIT, also in decoder_step's attention shapes, the kernels,
# the CSA2 layers at decode batches 1-64, the host sampler, then a whole decode step through the
# runtime) (tables last; JSON, plot and logs under $OUT).
#   bash scripts/gpu_check.sh [--tests-only | --kernel-tests | --other-tests | --runtime-tests | --bench-only
#       | --decode-only | --index-maxima] [--quick] [--sweep]
# (--tests-only: the tests and the AOT compile; since session 24 (2026-12-04) that passes 10 minutes
# (a 560 s limit stopped its pytest after 219 of ~290 tests), so on the device run it as three calls:
# --kernel-tests (tests/test_kernels.py, test_topk_kernel.py, test_kernels_gpu.py,
# test_qat_kernel.py, test_attention_gluon_gpu.py, test_fp4_query_split.py), --other-tests (test_aot_gpu.py,
# test_ort_cuda.py, test_compiled_step.py, the AOT compile) and --runtime-tests
# (test_runtime_gpu.py: on a fresh machine its tuned compile alone takes 5 minutes or more of
# coordinate-descent tuning; session 51, an H100: with test_compiled_step.py and test_aot_gpu.py
# before it, a 560 s limit stopped the call inside that compile);
# --bench-only: the kernel benchmarks;
# --decode-only: the whole-step benchmark (bench_decode.py --profile);
# --index-maxima: the listed index launch writing the top-k's block maxima (INDEX_MAXIMA, session
# 53: measured not faster, off by default) in one call: its GPU tests, the layers at 16-128 rows
# with and without it, and the 32-row listed layers' timelines with and without it (bf16 and FP4
# keys). On a fresh H200 the tests
# took 7 min with a cold Triton cache, 3-7 min since, the kernel benchmarks about 4 min and the
# decode benchmark about 6 (two inductor compiles of 1-2 min for the compiled mode, 2026-12-04):
# more than one 10-minute device call, so run the three parts as three calls there. The tests'
# pytest took 403 s on 2026-12-04 before tests/test_runtime_gpu.py gained the tuned-compile test
# (two more tiny compiles); if --tests-only nears 10 minutes, run that file in a call of its own.)
# The ort-cuda tests also run when onnxruntime-gpu is on PYTHONPATH and DSFLASH_TINY_BUNDLE names a
# portable tiny bundle made on the CPU machine (the GPU machine has no onnxruntime-gpu and no
# network: carry the wheel in parts with ../shared/tools/carry-wheel.sh, see docs/benchmarks.md);
# the bf16 graph check also needs DSFLASH_TINY_BF16_BUNDLE (scripts/export.py --config tiny
# --dtype bfloat16 --flavor portable --out engines/tiny-bf16, carried likewise), and the
# Polygraphy check on the CUDA provider also needs polygraphy (pip download polygraphy --no-deps;
# pure Python) on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/.gpu_site:${PYTHONPATH:-}"
# the package by path (the GPU image has no network for pip install -e); see scripts/gpu_site.sh
bash scripts/gpu_site.sh .gpu_site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
tests=0
run_tests=1
bench=1
decode=1
kernel_files="tests/test_kernels.py tests/test_topk_kernel.py tests/test_kernels_gpu.py"
kernel_files="$kernel_files tests/test_qat_kernel.py tests/test_attention_gluon_gpu.py"
kernel_files="$kernel_files tests/test_fp4_query_split.py"
# the quick files first: on a fresh machine (cold inductor caches) the runtime and compiled-step
# files take minutes of compiles (session 30, an H100: tests/test_runtime_gpu.py ran 7 minutes
# without finishing its tuned-compile test), so a time limit should stop those, not the AOT tests
other_files="tests/test_aot_gpu.py tests/test_ort_cuda.py tests/test_compiled_step.py"
runtime_files="tests/test_runtime_gpu.py"
test_files="$kernel_files $other_files $runtime_files"
aot=1
index_maxima=0
case "${1:-}" in
  --tests-only) shift; bench=0; decode=0 ;;
  --kernel-tests) shift; bench=0; decode=0; aot=0; test_files=$kernel_files ;;
  --other-tests) shift; bench=0; decode=0; test_files=$other_files ;;
  --runtime-tests) shift; bench=0; decode=0; aot=0; test_files=$runtime_files ;;
  --bench-only) shift; run_tests=0; decode=0 ;;
  --decode-only) shift; run_tests=0; bench=0 ;;
  --index-maxima) shift; run_tests=0; bench=0; decode=0; index_maxima=1 ;;
esac
if [ "$index_maxima" = 1 ]; then
  python3 -P -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py \
    tests/test_topk_kernel.py tests/test_bench_layer_batch.py -k "maxima or listed_pool" 2>&1 \
    | tee "$OUT/tests_index_maxima.log" | tail -3
  tests=${PIPESTATUS[0]}
  for over in INDEX_MAXIMA=False INDEX_MAXIMA=True; do
    name=${over//=/_}  # the device tool does not bring back names holding '='
    mkdir -p "$OUT/$name"
    python3 scripts/bench_layer_batch.py --out "$OUT/$name" --batches 16,32,64,128 --topk-over "$over" \
      2>&1 | tee "$OUT/bench_layer_batch_$name.log" | grep -v "it/s\]" | tail -6
  done
  for case in layer_listed_b32 layer_listed_b32_maxima layer_listed_fp4_b32 layer_listed_fp4_b32_maxima; do
    python3 scripts/profile_kernels.py --case "$case" --timeline 2>&1 | tee "$OUT/timeline_$case.log" \
      | tail -1
  done
fi
if [ "$run_tests" = 1 ]; then
  # shellcheck disable=SC2086  # the file lists split on spaces
  python3 -P -m pytest -q -p no:cacheprovider $test_files -rs --durations=12 2>&1 | tee "$OUT/tests.log"
  tests=${PIPESTATUS[0]}
  if [ "$aot" = 1 ]; then
    python3 scripts/aot_kernels.py --config flash --dtype bf16 --out "$OUT/kernels_flash" 2>&1 | tail -7 \
      | tee "$OUT/aot.log"
  fi
fi
if [ "$bench" = 1 ]; then
  python3 scripts/bench_floor.py --out "$OUT" 2>&1 | tail -2 | tee "$OUT/floor.log"
  python3 scripts/bench_aot.py --out "$OUT" 2>&1 | tee "$OUT/bench_aot.log" | grep -v "it/s\]" | tail -10
  # the attention plugins in decoder_step's shapes: where one node overtakes the split pair
  # (scripts/export.py --decode-attention)
  mkdir -p "$OUT/decode_attention"
  python3 scripts/bench_aot.py --out "$OUT/decode_attention" --only attention --attention-decode \
    --attention-rows 1,16,32,48,64,128 2>&1 | tee "$OUT/bench_aot_decode.log" | grep -v "it/s\]" | tail -7
  python3 scripts/bench_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "it/s\]" | tail -36
  python3 scripts/bench_layer_batch.py --out "$OUT" 2>&1 | tee "$OUT/bench_layer_batch.log" \
    | grep -v "it/s\]" | tail -8
  # the same layers with the Gluon attention launched with PDL (an option since session 52, when
  # it measured 2.3-3.2 us slower in 3-4 splits at 16-24 rows: docs, "Session 52")
  mkdir -p "$OUT/attn_pdl"
  python3 scripts/bench_layer_batch.py --out "$OUT/attn_pdl" --batches 16,32 --attn-over PDL=True \
    2>&1 | tee "$OUT/bench_layer_batch_attn_pdl.log" | grep -v "it/s\]" | tail -4
  # a listed pool's and a Full layer's top-k: the defaults against the fused passes with no early
  # stop, with other stops, with a launch per pass, with rank programs of 4 warps comparing 256
  # keys, with the collect and the passes in their former widths, and with the live collect over
  # 32, 16 or 8 blocks a step whatever the grid (docs, session 48: the stop 1.11x / 1.19x at 32 / 64
  # rows, one-warp rank programs 1.03x-1.15x; session 49: the one-warp collect and four pass warps
  # 1.07x-1.14x from 32 rows; session 50: the blocks a step from the grid's rounds of the SM slots,
  # live_steps.py, up to 1.10x for the Full layer's scores from 48 rows; the rank's tie path in steps
  # of 512 over chunks of 2,048, against whole chunks and steps of 1,024: 1.02x-1.08x)
  mkdir -p "$OUT/topk_listed"
  python3 scripts/bench_layer_batch.py --out "$OUT/topk_listed" --batches 16,32,48,64,96,128 \
    --topk-kinds full,listed --topk-sweep "EARLY_SLACK=off;EARLY_SLACK=0;EARLY_SLACK=128;PASS_LAUNCH=each;\
RANK_WARPS=4,CMP_BLOCK=256;PASS_WARPS=8;COLLECT_WARPS=4;LIVE_BLOCKS=32;LIVE_BLOCKS=16;LIVE_BLOCKS=8;TIE_STEP=2048;\
TIE_STEP=1024" 2>&1 \
    | tee "$OUT/topk_listed.log" | grep "batch" | tail -6
  # the rank steps' keys straight into the compare's layout, a step ahead, 64 a step (the default
  # at 16-64 rows since session 52) against the former vector loads of 128, the tile loads at 128
  # keys a step, and the rank's tie path in steps of 256 (session 50: slower than 512 on a listed
  # pool's chunks of 512 / 1,024)
  mkdir -p "$OUT/topk_rank_loads"
  python3 scripts/bench_layer_batch.py --out "$OUT/topk_rank_loads" --batches 16,32,64,128 \
    --topk-kinds full,listed --topk-sweep "RANK_TILE=False,RANK_AHEAD=False,CMP_BLOCK=128;\
RANK_TILE=True,RANK_AHEAD=True,CMP_BLOCK=128;RANK_TILE=True,RANK_AHEAD=False;TIE_STEP=256" 2>&1 \
    | tee "$OUT/topk_rank_loads.log" | grep "batch" | tail -4
  # one replay of the listed Reindex layer at 32 rows, kernel by kernel with the gaps between them
  # (docs, session 46: where the layer's time goes)
  python3 scripts/profile_kernels.py --case layer_listed_fp4_b32 --timeline 2>&1 \
    | tee "$OUT/timeline_listed_fp4_b32.log" | tail -1
  # the listed FP4 index kernel over five patterns of ids and its reads alone: what bounds it
  # (docs, sessions 42-43); the listed kernels at other pipeline depths against their defaults
  python3 scripts/index_fp4_ablation.py --out "$OUT" 2>&1 | tee "$OUT/index_fp4_ablation.log" | tail -4
  python3 scripts/listed_stages_sweep.py --out "$OUT" --rows 32,64,128 --kernels fp4,bf16 \
    --settings 3:4,5:8,5:16 2>&1 | tee "$OUT/listed_stages_sweep.log" | tail -6
  # one flash MoE layer in the export's two decoder_step forms (--decode-moe; 54 GB at its peak)
  python3 scripts/bench_moe_dispatch.py --out "$OUT" 2>&1 | tee "$OUT/bench_moe_dispatch.log" | grep "^|" | tail -6
  # the sampler on this machine's host CPU, and select_tokens from logits on the GPU
  python3 scripts/bench_sampling.py --out "$OUT" 2>&1 | tee "$OUT/bench_sampling.log" | grep "^|" | tail -20
fi
if [ "$decode" = 1 ]; then
  python3 scripts/bench_decode.py --out "$OUT" --profile 2>&1 | tee "$OUT/bench_decode.log" \
    | grep -v "it/s\]" | grep "^|\|^copy\|step, batch" | head -12
fi
echo "gpu tests exit status: $tests"
exit "$tests"
