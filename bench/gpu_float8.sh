#!/usr/bin/env bash
# Issue 47's float8 figures on one H100/H200, logs under $OUT (the device tool's output folder):
#   OUT=/tmp/out bash bench/gpu_float8.sh
# The device reaches no package index: fetch the pinned torchao wheel here first and carry it,
#   pip download --no-deps torchao==0.18.0 -d .device    (.device/ is ignored by git; carry=[".device"])
# The 1B step compiled in bf16, float8 tensorwise and float8 rowwise (tokens/s, bench/gpu_step.py);
# then examples/llama/train.py for 200 steps on the stdlib corpus in bf16 and in float8 tensorwise,
# the same seed and batches: the last logged loss of each. About 8 minutes on an H100.
set -uo pipefail
OUT=${OUT:-gpu_float8}
mkdir -p "$OUT"
export OMP_NUM_THREADS=8
python -m pip install --quiet --no-deps --no-index .device/torchao-*.whl 2>&1 | tail -1
python -c "import torch, torchao; print(torch.__version__, torch.cuda.get_device_name(), 'torchao', torchao.__version__)" \
    | tee "$OUT/device.txt"
step() { local name=$1; shift; timeout 300 python bench/gpu_step.py "$@" 2>&1 | tee "$OUT/$name.txt" | tail -4; }
step bf16
step float8_tensorwise --float8 tensorwise
step float8_rowwise --float8 rowwise
train() {
    local name=$1; shift
    timeout 420 torchrun --standalone --nproc-per-node 1 examples/llama/train.py --config 1B --param-dtype bf16 \
        --seq-len 2048 --global-batch 4 --steps 200 --compile --log-every 50 --metrics "$OUT/$name.jsonl" "$@" \
        2>&1 | tee "$OUT/$name.txt" | tail -3
}
train curve_bf16
train curve_float8 --float8 tensorwise
python - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
speed = {n: float(re.search(r"([\d,]+) tokens/s", open(f"{out}/{n}.txt").read()).group(1).replace(",", ""))
         for n in ("bf16", "float8_tensorwise", "float8_rowwise")}
for n in ("float8_tensorwise", "float8_rowwise"):
    print(f"{n}: {speed[n]:,.0f} tokens/s, {speed[n] / speed['bf16']:.3f}x bf16's {speed['bf16']:,.0f}")
last = {n: [json.loads(l) for l in open(f"{out}/{n}.jsonl")][-1]["loss"] for n in ("curve_bf16", "curve_float8")}
print(f"loss after 200 steps: bf16 {last['curve_bf16']:.4f}, float8 {last['curve_float8']:.4f}, "
      f"{last['curve_float8'] / last['curve_bf16'] - 1:+.2%}")
PY
