#!/usr/bin/env bash
# Runs Spillway's GPU test suite and GPU benchmarks on a machine with an NVIDIA GPU, from
# binaries built elsewhere, and writes every log and JSON file to the folder given.
#
#   cargo build --release --features spillway-cli/cuda            # on the build machine
#   bench/gpu/build-dist.sh                                       # gathers dist/gpu/
#   bench/gpu/run.sh OUT_DIR                                      # on the GPU machine
#   python3 bench/gpu/record.py OUT_DIR >> bench/RESULTS.md        # back on the build machine
#
# Needs on the GPU machine: the NVIDIA driver, cuBLAS (the CUDA toolkit's lib64, found
# through LD_LIBRARY_PATH below), python3 with PyTorch for the baseline. Each step's exit
# status is written to OUT_DIR/status.txt; the script goes on after a failed step.
set -u
out=${1:?usage: bench/gpu/run.sh OUT_DIR}
bin=${SPILLWAY_GPU_BIN:-dist/gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export RUST_BACKTRACE=1
: > "$out/status.txt"

step() { # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" >&2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - t0))" >> "$out/status.txt"
}

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
step gpu-tests 400 env SPILLWAY_BENCH_OUT="$out" "$bin/gpu-tests" --test-threads=1 --nocapture
step demo-cuda 300 "$bin/spillway" demo --device cuda --json
step gpu-offload-8mib 500 "$bin/spillway" bench gpu-offload --json --page-size 8MiB
step gpu-offload-2mib 500 "$bin/spillway" bench gpu-offload --json --page-size 2MiB
step torch-offload 400 python3 bench/baselines/torch_offload.py
step replay-dense-cuda 300 "$bin/spillway" replay bench/traces/dense.jsonl --device cuda --compare --json
step replay-moe-cuda 300 "$bin/spillway" replay bench/traces/moe.jsonl --device cuda --compare --json
step python-tests 300 python3 -m unittest discover python/tests
cat "$out/status.txt"
