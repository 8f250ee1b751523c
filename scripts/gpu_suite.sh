#!/usr/bin/env bash
# One device call: GPU tests, then kernel/drafting benchmarks, then speculative decoding with
# exported drafters, results under $OUT (a short table printed last).
#   carry: .whl (scripts/build_wheelhouse.sh) and .gpu_carry (exported drafters to run)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# `kernels/` is imported as `draftkernels` (pyproject package-dir); mirror that without installing.
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/draftkernels
export PYTHONPATH=/tmp/site:/tmp/pp:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/suite.log"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/suite.log"

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_native_target.py \
  tests/test_rejection_sampler.py tests/test_parallel_layout.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
timeout 120 python3 scripts/bench_parallel_layout.py --out "$OUT/bench_parallel_layout.json" \
  2>&1 | tail -40 >> "$OUT/suite.log"
timeout 180 python3 scripts/bench_drafting.py --out "$OUT/bench_drafting.json" 2>&1 \
  | tail -12 | tee -a "$OUT/suite.log"
for spec in .gpu_carry/*/; do
  name=$(basename "$spec"); k=$(cat "$spec/K" 2>/dev/null || echo 3)
  for dt in bfloat16 float32; do
    timeout 120 python3 -m draftinfer drafter="$spec" target=zoo:llama-tiny k="$k" dtype=$dt \
      num_prompts=64 batch_size=16 max_new_tokens=64 max_model_len=384 progress=false \
      report="$OUT/spec_${name}_${dt}.json" 2>&1 | tail -9 | sed "s/^/[$name $dt] /"
  done
done | tee -a "$OUT/suite.log"
rm -f "$OUT"/*.png
echo "== pytest"; tail -3 "$OUT/pytest_gpu.log"
echo "== drafting"; grep -A8 "drafting time per round" "$OUT/suite.log"
