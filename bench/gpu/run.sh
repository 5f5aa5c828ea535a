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
#
# SPILLWAY_GPU_STEPS, when set, names the steps to run (space-separated, e.g.
# "gpu-tests gpu-offload torch-offload"); gpu-offload runs every page size of
# SPILLWAY_GPU_PAGES (default "2MiB 8MiB 64MiB"). SPILLWAY_GPU_PROFILE=1 also profiles one
# short 2 MiB run with nsys (or perf) when the machine has it.
set -u
out=${1:?usage: bench/gpu/run.sh OUT_DIR}
bin=${SPILLWAY_GPU_BIN:-dist/gpu}
steps=${SPILLWAY_GPU_STEPS:-"gpu-tests demo-cuda gpu-offload torch-offload replay-dense-cuda replay-moe-cuda python-tests"}
pages=${SPILLWAY_GPU_PAGES:-"2MiB 8MiB 64MiB"}
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export RUST_BACKTRACE=1
: > "$out/status.txt"

wanted() { [[ " $steps " == *" $1 "* ]]; }

step() { # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" >&2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - t0))" >> "$out/status.txt"
    if [ -n "${SPILLWAY_GPU_PACK:-}" ]; then
        tar czf "$SPILLWAY_GPU_PACK.part" -C "$out" . && mv "$SPILLWAY_GPU_PACK.part" "$SPILLWAY_GPU_PACK"
    fi
}

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
wanted gpu-tests && step gpu-tests 400 env SPILLWAY_BENCH_OUT="$out" "$bin/gpu-tests" --test-threads=1 --nocapture
wanted demo-cuda && step demo-cuda 300 "$bin/spillway" demo --device cuda --json
if wanted gpu-offload; then
    for p in $pages; do
        step "gpu-offload-$(echo "$p" | tr 'A-Z' 'a-z')" 500 "$bin/spillway" bench gpu-offload --json --page-size "$p"
    done
fi
wanted torch-offload && step torch-offload 400 python3 bench/baselines/torch_offload.py
if [ "${SPILLWAY_GPU_PROFILE:-0}" = 1 ]; then
    short=("$bin/spillway" bench gpu-offload --page-size 2MiB --batch 4096 --iters 3)
    if command -v nsys > /dev/null; then
        step profile-nsys 240 nsys profile -t cuda,osrt -s none --stats=true -o "$out/gpu-offload-2mib" "${short[@]}"
    elif command -v perf > /dev/null; then
        step profile-perf 240 perf record -g -o "$out/perf.data" "${short[@]}"
        perf report -i "$out/perf.data" --stdio --no-children --percent-limit 1 > "$out/profile-perf.txt" 2>&1
        rm -f "$out/perf.data"
    else
        echo "profile: neither nsys nor perf on this machine" >> "$out/status.txt"
    fi
fi
wanted replay-dense-cuda && step replay-dense-cuda 300 "$bin/spillway" replay bench/traces/dense.jsonl --device cuda --compare --json
wanted replay-moe-cuda && step replay-moe-cuda 300 "$bin/spillway" replay bench/traces/moe.jsonl --device cuda --compare --json
wanted python-tests && step python-tests 300 python3 -m unittest discover python/tests
cat "$out/status.txt"
