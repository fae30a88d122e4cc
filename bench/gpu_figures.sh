#!/usr/bin/env bash
# Every GPU figure docs/performance.md records for one H100/H200, in one run, logs under $OUT
# (the device tool's output folder; ./gpu_figures otherwise):
#   OUT=/tmp/out bash bench/gpu_figures.sh
# The 1B step eager and compiled (and compiled with the head and loss fused), its profile by kernel
# kind (and the SDPA backend), eager on each SDPA kernel, one cp rank's attention (bench/cp_attention.py),
# the same step as 4 local stages (the pipeline engine's own cost), then tests/gpu. About 8 minutes on an H100.
set -uo pipefail
OUT=${OUT:-gpu_figures}
mkdir -p "$OUT"
export OMP_NUM_THREADS=8
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
step() { local name=$1; shift; timeout 300 python bench/gpu_step.py "$@" 2>&1 | tee "$OUT/$name.txt" | tail -5; }
step compiled --profile "$OUT/profile_compiled"
step eager --no-compile --profile "$OUT/profile_eager"
step compiled_fused_loss --fused-loss
# the attention on each exact SDPA kernel torch has for it (eager: the kernels alone decide)
for backend in flash cudnn efficient; do step "eager_sdpa_$backend" --no-compile --steps 5 --sdpa-backend "$backend"; done
# one cp rank's attention at 32k..262k tokens (Llama 3 8B's heads) against the planner's rate
timeout 240 python bench/cp_attention.py 2>&1 | tee "$OUT/cp_attention.txt" | tail -6
step stages1 --no-compile --microbatches 4
step stages4 --no-compile --virtual-stages 4 --microbatches 4
python - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
ms = {n: float(re.search(r"step ([\d.]+) ms", open(f"{out}/{n}.txt").read()).group(1)) for n in ("stages1", "stages4")}
print(f"pipeline engine at 4 local stages: {ms['stages4']:.1f} ms against {ms['stages1']:.1f} ms at 1: "
      f"{ms['stages4'] / ms['stages1'] - 1:+.1%} of the step")
PY
timeout 600 python -m pytest -q tests/gpu 2>&1 | tee "$OUT/tests_gpu.txt" | tail -3
