#!/usr/bin/env bash
# Replays every trace in bench/traces/ on the GPU with `--compare` (on_demand, clock,
# learned), once with the cuda device's default (per-lane submitter threads) and once with
# SPILLWAY_CUDA_SUBMIT=inline, and packs the JSON results, the exit statuses and the last
# lines of each run's stderr into ONE tarball (the device tool returns a few files only).
#
#   bench/gpu/build-dist.sh                       # on the build machine
#   bench/gpu/replay-all.sh OUT_DIR               # on the GPU machine: OUT_DIR/replay.tar.gz
#   tar xzf replay.tar.gz -C bench/gpu/runs/NAME  # back on the build machine
#
# SPILLWAY_REPLAY_TRACES names the traces (default: every bench/traces/*.jsonl);
# SPILLWAY_REPLAY_MODES the modes ("default inline").
set -u
out=${1:?usage: bench/gpu/replay-all.sh OUT_DIR}
bin=${SPILLWAY_GPU_BIN:-dist/gpu}
modes=${SPILLWAY_REPLAY_MODES:-"default inline"}
traces=${SPILLWAY_REPLAY_TRACES:-$(ls bench/traces/*.jsonl | xargs -n1 basename | sed 's/\.jsonl$//')}
work=$(mktemp -d)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
mkdir -p "$out"
pack() {
    tar czf "$out/replay.tar.gz.part" --exclude=./err -C "$work" . && mv "$out/replay.tar.gz.part" "$out/replay.tar.gz"
}
: > "$work/status.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$work/nvidia-smi.csv" 2>&1
t0=$SECONDS
timeout 120 "$bin/gpu-tests" --test-threads=1 > "$work/gpu-tests.out" 2>&1
echo "gpu-tests rc=$? s=$((SECONDS - t0))" >> "$work/status.txt"
pack
for trace in $traces; do
    for mode in $modes; do
        mkdir -p "$work/$mode"
        env_submit=()
        [ "$mode" = inline ] && env_submit=(SPILLWAY_CUDA_SUBMIT=inline)
        env "${env_submit[@]}" timeout 200 "$bin/spillway" replay "bench/traces/$trace.jsonl" \
            --compare --repeats 3 --device cuda --json > "$work/$mode/$trace.json" 2> "$work/err"
        echo "$mode $trace rc=$? s=$((SECONDS - t0))" >> "$work/status.txt"
        tail -n 20 "$work/err" > "$work/$mode/$trace.err-tail"
        pack # after every run: a run cut off by the tool's time limit keeps what finished
    done
done
rm -f "$work/err"
pack
cat "$work/status.txt"
