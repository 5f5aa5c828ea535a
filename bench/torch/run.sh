#!/usr/bin/env bash
# Runs the spillway.torch benchmark on a GPU machine from a wheel built elsewhere:
#
#   (cd crates/spillway-py && maturin build --release -o ../../dist/py)   # build machine
#   bench/torch/run.sh OUT_DIR                                             # GPU machine
#   python3 bench/torch/section.py OUT_DIR/bench-torch.json "COMMAND" IDENTITY.json "COMMAND" --write bench/RESULTS.md
#
# Installs dist/py/*.whl (no dependencies: the machine has torch, transformers,
# accelerate, numpy), runs the Python package's tests there (the CUDA view tests run; the
# daemon tests need dist/gpu/spillway), a small smoke run of the benchmark, then the
# benchmark itself. pytest comes from dist/py/deps when the machine lacks it
# (`pip download pytest -d dist/py/deps --only-binary=:all: --python-version 3.12`). Exit statuses go to OUT_DIR/status.txt.
set -u
out=${1:?usage: bench/torch/run.sh OUT_DIR}
mkdir -p "$out"
: > "$out/status.txt"
step() { # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"
    echo "$name rc=$? seconds=$((SECONDS - t0))" >> "$out/status.txt"
}
step pip 120 python3 -m pip install --no-deps --no-index --force-reinstall dist/py/*.whl
python3 -c 'import pytest' 2>/dev/null || \
    step pip-pytest 120 python3 -m pip install --no-index --find-links dist/py/deps pytest
[ -x dist/gpu/spillway ] && export SPILLWAY_BIN=$PWD/dist/gpu/spillway
step pytest 120 python3 -m pytest -q -rs crates/spillway-py/tests
step smoke 120 python3 bench/torch/bench_torch.py --layers 2 --hidden 1024 --intermediate 2816 \
    --vocab 8000 --seq 256 --gpu-budget 256MiB --train-steps 3 --infer-steps 3 --skip fsdp2 \
    --out "$out/smoke.json"
step bench "${SPILLWAY_TORCH_BENCH_TIMEOUT_S:-420}" python3 bench/torch/bench_torch.py \
    ${SPILLWAY_TORCH_BENCH_ARGS:-} --out "$out/bench-torch.json"
cat "$out/status.txt"
