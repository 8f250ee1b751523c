#!/usr/bin/env bash
# One device call: GPU tests (incl. the no-host-sync round), then the round benchmark at
# Llama-3.1-8B shapes; results under $OUT (a short table printed last).
#   carry: .whl (scripts/build_wheelhouse.sh)
#   usage: bash scripts/gpu_suite.sh [tests|tests-rounds|tests-rest|bench-1|bench-8|bars-a|bars-b|all]
# `bars-a` / `bars-b`: the rounds at their bars' K (ptd 4, eagle3 3 / mtp 3, dflash 7),
# batch 1, the runner's compiled default, beside gpt-fast's step (`peers/gpt-fast`, carried):
# one call each (docs/results.md, "Where the performance bars stand").
# A cold machine compiles the rounds' GPU tests (T1, no host sync, B4: ~330 s for the last two
# on 2026-11-26) too slowly to run everything in one 10-minute call: take `tests-rounds` and
# `tests-rest` as two calls there (`tests` runs both). The tests build their `SpecDecoder`s
# without programmatic dependent launch; `DRAFTKERNELS_PDL=1 bash scripts/gpu_suite.sh ...`
# runs them as the runner compiles its job on CUDA (`InferConfig.pdl`, docs/inference.md).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# The checkout's packages are imported from $PWD without installing them; `kernels/` and
# `conf/` are imported as `draftkernels` and `draftconf` (setup.py's package_dir): mirror
# that with links.
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/draftkernels && ln -sfn "$PWD/conf" /tmp/pp/draftconf
export PYTHONPATH=/tmp/site:/tmp/pp:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/suite.log"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/suite.log"

rounds="t1 or no_host_sync or b4"
# One process (the GPU machine has no pytest-xdist; pyproject's addopts ask for two workers).
pytest=(python3 -m pytest -o "addopts=-ra --strict-markers" -q -p no:cacheprovider)
# INDUCTOR="name=value ..." runs the tests with those inductor settings added to the runner's
# CUDA default (combo kernels; tests/conftest.py's --inductor): a candidate default's GPU tests.
inductor=()
for x in ${INDUCTOR:-}; do inductor+=(--inductor "$x"); done
if [ "$what" = tests ] || [ "$what" = tests-rounds ] || [ "$what" = all ]; then
  timeout 560 "${pytest[@]}" -m gpu "${inductor[@]}" tests/gpu/test_gpu.py \
    -k "$rounds" 2>&1 | tee "$OUT/pytest_gpu_rounds.log" | tail -8
fi
if [ "$what" = tests ] || [ "$what" = tests-rest ] || [ "$what" = all ]; then
  timeout 300 "${pytest[@]}" -m gpu "${inductor[@]}" tests/gpu/test_gpu.py \
    tests/infer/test_native_target.py tests/kinds/test_dflash_options.py \
    tests/kinds/test_dflash_train.py -k "not ($rounds)" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
  timeout 200 "${pytest[@]}" tests/kernels/test_rejection_sampler.py \
    tests/kernels/test_parallel_layout.py tests/kernels/test_chain_inputs.py \
    tests/kernels/test_decode_attention.py tests/kernels/test_skinny_gemm.py \
    tests/infer/test_serving_transforms.py 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -3
fi
for half in a b; do
  if [ "$what" = "bars-$half" ]; then
    ks=$([ "$half" = a ] && echo ptd:4,eagle3:3 || echo mtp:3,dflash:7)
    timeout 580 python3 -m draftbench.round --batches 1 --kinds "${ks//:[0-9]/}" --ks "$ks" \
      --graph-only --fuse-only --breakdown --out "$OUT/bars_$half.json" 2>&1 \
      | tee "$OUT/bars_$half.log" | grep -v Warn | tail -8
  fi
done
for b in 1 8; do
  if [ "$what" = "bench-$b" ] || [ "$what" = all ]; then
    timeout 560 python3 -m draftbench.round --batches "$b" \
      --out "$OUT/bench_round_b$b.json" 2>&1 | tee "$OUT/bench_round_b$b.log" | tail -12
  fi
done
