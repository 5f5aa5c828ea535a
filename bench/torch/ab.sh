#!/usr/bin/env bash
# One arm of an A/B of the training part of bench_torch.py on a GPU machine: installs
# the wheel in dist/TAG/ (built here with
# `(cd crates/spillway-py && maturin build --release -o ../../dist/TAG)`), then runs
# learned against hand-written offload and the copy floor (no FSDP2, no on-demand, no
# inference), writing $OUT/ab-TAG.out and $OUT/ab-TAG.json. Run both arms in one device
# call so that their ratios come from the same machine:
#
#   bash bench/torch/ab.sh base 170; bash bench/torch/ab.sh new 170
#
# Env: STEPS (training steps, default 5), EXTRA (more bench_torch.py arguments, e.g.
# `--equal-memory-variant` or `--profile $OUT/prof`).
set -u
tag=${1:?usage: bench/torch/ab.sh TAG [TIMEOUT_S]}
limit=${2:-170}
out=${OUT:?OUT must name the output folder}
python3 -m pip install -q --no-deps --no-index --force-reinstall dist/"$tag"/*.whl \
    > "$out/ab-$tag.pip" 2>&1 || { echo "ab $tag: pip failed"; cat "$out/ab-$tag.pip"; exit 1; }
t0=$SECONDS
# shellcheck disable=SC2086 # EXTRA is a list of arguments
timeout "$limit" python3 bench/torch/bench_torch.py --parts train --skip fsdp2 on_demand \
    --train-steps "${STEPS:-5}" ${EXTRA:-} --out "$out/ab-$tag.json" > "$out/ab-$tag.out" 2>&1
rc=$?
echo "rc=$rc wall=$((SECONDS - t0))" >> "$out/ab-$tag.out"
tail -n 25 "$out/ab-$tag.out"
