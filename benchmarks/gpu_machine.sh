#!/usr/bin/env bash
# What a machine with a CUDA GPU and many cores checks for zmqsync, in one go and within
# a time budget: the CUDA tests, the CUDA IPC benchmark (a learner's version to workers
# on its own GPU against hand-written CUDA IPC) and the one-host peers benchmark on that
# machine's cores. Each step gets what is left of the budget (a step that would start
# with under a minute left is skipped and said so); its output lands in OUTDIR.
#
#   bash benchmarks/gpu_machine.sh [OUTDIR] [SECONDS]
#
# OUTDIR defaults to benchmarks/results/gpu_machine, SECONDS to 540. zmqsync and its
# dependencies must be importable by `python3` (installed, or on PYTHONPATH). On a
# machine without CUDA it runs all the same, as a smoke test of the script: the CUDA
# tests skip, and the CUDA IPC benchmark runs one small size on the CPU.
set -u

OUT=${1:-benchmarks/results/gpu_machine}
BUDGET=${2:-540}
PY=${PYTHON:-python3}
START=$(date +%s)
mkdir -p "$OUT"

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME CAP COMMAND...: runs COMMAND with at most CAP seconds (less if the budget
# has less), its output in OUT/NAME.log; says how it ended in OUT/summary.txt.
step() {
    local name=$1 cap=$2
    shift 2
    local limit
    limit=$(left)
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 60 ]; then
        echo "$name: skipped, ${limit}s of the budget left" | tee -a "$OUT/summary.txt"
        return
    fi
    local began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - began))s (limit ${limit}s)" | tee -a "$OUT/summary.txt"
}

: > "$OUT/summary.txt"
# The streaming copies' C extension, built in place where this tree has none and a
# compiler is there (without it, torch copies: machine.txt says which).
"$PY" -c 'import zmqsync.tensors._streamcopy' 2> /dev/null \
    || "$PY" setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 \
    || echo "the C extension did not build: see build_ext.log"
{
    date -u
    nproc
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import sys, torch, zmq; print(sys.version.split()[0], torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda", "pyzmq", zmq.__version__)'
    "$PY" -c 'from zmqsync.tensors import streaming; print("streaming copies:", streaming.AVAILABLE)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    IPC=(--device cuda --sizes 16MB,128MB,1GB --workers 1,2,4 --repeats 20)
else  # a smoke test: 1 GB to 4 workers, each with three copies, is no CPU's job
    IPC=(--device cpu --sizes 16MB --workers 1,2 --repeats 5)
fi

step cuda_tests 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py
step cuda_ipc 180 "$PY" -m benchmarks.cuda_ipc "${IPC[@]}" --json "$OUT/cuda_ipc.json"
step peers 600 "$PY" -m benchmarks.transports --sizes 1MB,16MB,128MB --workers 1,2,4,8 \
    --variants zmqsync-pipe,zmqsync-pipe-shared,zmqsync-zmq,torchrl-shm,gloo-flat,memcpy \
    --json "$OUT/peers.json" --markdown "$OUT/peers.md"
tail -n 3 "$OUT/cuda_tests.log" 2>/dev/null
cat "$OUT/summary.txt"
