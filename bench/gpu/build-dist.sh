#!/usr/bin/env bash
# Builds the GPU binaries (no CUDA needed to build) and gathers them in dist/gpu/ for
# bench/gpu/run.sh: the `spillway` binary with the cuda feature and the GPU test suite.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --features spillway-cli/cuda
mkdir -p dist/gpu
cp target/release/spillway dist/gpu/spillway
tests=$(cargo test --release -p spillway-device --features cuda --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
cp "$tests" dist/gpu/gpu-tests
strip dist/gpu/spillway dist/gpu/gpu-tests
ls -la dist/gpu
