#!/usr/bin/env bash
# The GPU check: every CUDA line run once, on a machine with a CUDA GPU.
#
#     bash bench/gpu_check.sh             # on the GPU machine, from the repository root
#     bash bench/gpu_check.sh --dry-run   # here, on the CPU: the same steps, CUDA aside
#
# Each step has its own time limit, writes its output to $OUT (default ./gpu-out) and does not
# stop the steps after it; $OUT/steps.log says how each ended. On the GPU machine it first
# installs what the image lacks from the wheels in .whl/ (transformers in the range the
# embedded engine takes, and the pure-Python dependencies the image has not) into /tmp/site,
# then the project itself (editable, no dependencies: its entry points, `agentenv` and the
# env ids, exist only once it is installed). A GPU container has no writable cgroups: the
# local sandbox runs there with the isolation the host has (--sandbox-unisolated). The steps:
#   1. pytest -m gpu (tests/test_cuda.py and the CUDA test of tests/test_devices.py);
#   2. bench/gpu.py: the trainer's throughput, decode tok/s, whole vs chunked logprobs at 8k
#      tokens, packed vs padded, the bundled model through the Trainer, and
#      `agentenv train --device cuda --steps 5` (-> $OUT/gpu.json; its results record,
#      bench/results/gpu.json with the machine and versions, -> $OUT/gpu-record.json).
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=cuda
if [ $DRY = 1 ]; then
    DEVICE=cpu
    export AGENTENV_GPU_DRY_RUN=1
fi

note() { echo "$*" | tee -a "$OUT/steps.log"; }

step() {  # step NAME SECONDS COMMAND...: its output to $OUT/NAME.log, how it ended to steps.log
    local name=$1 limit=$2 start rc
    shift 2
    note "== $name (limit ${limit}s) $(date -u +%T)"
    start=$(date +%s)
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    note "$name: exit $rc in $(( $(date +%s) - start ))s$([ $rc = 124 ] && echo ' (timed out)')"
    tail -n 4 "$OUT/$name.log"
}

if [ $DRY = 0 ]; then
    note "== install $(date -u +%T)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/install.log" 2>&1 || note "install: the wheels failed (see install.log)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
        || note "install: the project failed (see install.log)"
else
    PY=${PYTHON:-.venv/bin/python}
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    $PY -c 'import torch, transformers, agentenv; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "| transformers", transformers.__version__, "| agentenv", agentenv.__file__)'
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log" | tee -a "$OUT/steps.log"

step pytest 300 $PY -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_devices.py
if [ $DRY = 1 ]; then
    step gpu 600 $PY bench/gpu.py --device cpu --quick --json "$OUT/gpu.json"
else
    step gpu 480 $PY bench/gpu.py --device cuda --sandbox-unisolated --json "$OUT/gpu.json"
    cp bench/results/gpu.json "$OUT/gpu-record.json" 2>/dev/null || note "no bench/results/gpu.json"
fi
note "== done $(date -u +%T)"
