#!/usr/bin/env bash
# The CUDA checks a CPU machine cannot run; writes a short report.
#   tests/gpu/run.sh [REPORT]        (default: gpu-report.txt; run from the repository root)
# 1. a DLRM step and the tensor-parallel layers on CUDA against CPU (tests/unit/test_cuda.py)
# 2. NCCL: a one-rank group, the tensor-parallel layers over it, the torch allreduce on a CUDA
#    tensor (tests/gpu/test_gpu_paths.py)
# 3. training on CUDA against CPU, replicated tables and with the hot tier on the device
#    (1 server + 1 worker): final train loss side by side
# 4. hpctrain bench dlrm on the device
set -u
cd "$(dirname "$0")/../.."
REPORT=${1:-gpu-report.txt}
PY=${PYTHON:-python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "tests/gpu/run.sh: no CUDA device visible to torch on this machine; nothing run" >&2
    exit 3
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0
{
    echo "hpctrain GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
"device", torch.cuda.get_device_name(0), "NCCL", torch.cuda.nccl.version())'
} > "$REPORT"

step() {  # step NAME COMMAND...: run, log the last lines, record pass/fail
    local name=$1; shift
    echo "== $name" | tee -a "$REPORT"
    if "$@" > "$WORK/out" 2>&1; then echo "PASS $name" >> "$REPORT"
    else echo "FAIL $name (exit $?)" >> "$REPORT"; status=1; fi
    tail -n 15 "$WORK/out" >> "$REPORT"
}

step "CUDA against CPU (step, tp layers)" "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py
step "NCCL one-rank group, tp layers over NCCL, torch allreduce" \
    "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_paths.py

SMALL=(--set train.progress=false --set train.steps=40 --set data.train_samples=40000
       --set data.eval_samples=4000)
train() {  # train NAME RANKS ARGS...: one run, its summary.json under $WORK/NAME
    mpiexec -n "$2" "$PY" -m hpctrain.cli train "${SMALL[@]}" "${@:3}" \
        --set "train.run_dir='$WORK/$1'"
}
compare() {  # compare A B: final train loss of runs A and B within 2%
    "$PY" - "$WORK/$1/summary.json" "$WORK/$2/summary.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
la, lb = a["train_loss"], b["train_loss"]
print(f"train loss {la:.5f} against {lb:.5f}; samples/s {a['samples_per_s']:.0f} against "
      f"{b['samples_per_s']:.0f}")
sys.exit(0 if abs(la - lb) <= 0.02 * abs(lb) else 1)
PYEOF
}
both() {  # both NAME RANKS ARGS...: CUDA and CPU runs, compared
    local name=$1 ranks=$2; shift 2
    train "$name-cuda" "$ranks" --set runtime.device=cuda "$@" &&
        train "$name-cpu" "$ranks" --set runtime.device=cpu "$@" &&
        compare "$name-cuda" "$name-cpu"
}
step "train on CUDA against CPU (replicated tables)" both replicated 1
step "train on CUDA against CPU (hot tier on the device, 1 server + 1 worker)" \
    both tiered 2 --set ps.servers=1 --set tiering.budget=0.2
step "bench dlrm on the device" "$PY" -m hpctrain.cli bench dlrm jobs/configs/dlrm_reference.toml \
    --set runtime.device=cuda --steps 20 --rounds 3
echo "report: $REPORT"
exit $status
