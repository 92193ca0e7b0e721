#!/usr/bin/env bash
# The learned cost model (issue 30) on a GPU, in one device call: the GPU test of the cost
# measurements; compute cost samples of random table sets looked up on the GPU (torch kernel;
# for at most COLLECT_S seconds); the learned model's held-out error beside the analytic form's;
# the analytic planner's lookup throughput calibrated on the GPU; and the sharding tasks
# (benchmarks/sharding_tasks.py) planned by each planner and measured on the GPU, lookups only
# (one GPU: no all-to-all of GPU ranks). Everything lands in OUT_DIR (default $OUT).
#   DEVICE=cpu COLLECT=60 COLLECT_S=20 TASKS=2 bash benchmarks/gpu_cost_model.sh  # a dry run
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/bench/gpu-cost}}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-4096}
COLLECT=${COLLECT:-5000}
COLLECT_S=${COLLECT_S:-120}
TASKS=${TASKS:-30}
PY=${PY:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD"
if [ -d .whl ] && ! $PY -c "import pydantic" 2>/dev/null; then  # the lent GPU machine
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if [ "$DEVICE" = cuda ]; then
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/sharding/test_learned_cost.py
fi
$PY benchmarks/learned_cost.py --device "$DEVICE" --collect "$COLLECT" \
  --collect-seconds "$COLLECT_S" --batch-size "$BATCH" --held-out 400 --train-sizes 100000 \
  --save-samples "$OUT_DIR/samples.parquet" --save-model "$OUT_DIR/model.json" \
  --out "$OUT_DIR/learned_cost.json"
$PY -c "
from raydlrm.sharding import calibrate, save_constants
save_constants(calibrate(comm=False, kernel='auto', device='$DEVICE'), '$OUT_DIR/constants.json')"
$PY benchmarks/sharding_tasks.py --device "$DEVICE" --no-comm --model "$OUT_DIR/model.json" \
  --constants "$OUT_DIR/constants.json" --planners random,size-greedy,lookup-greedy,analytic,neural \
  --tasks "$TASKS" --ranks 2 4 --batch-size "$BATCH" --out "$OUT_DIR/sharding_tasks.json"
