#!/usr/bin/env bash
# Bit-identity of spillway.torch training (eager attention) with each of the cuda
# device's diagnostic switches (crates/spillway-device/src/cuda/mod.rs, "Diagnostics"),
# to tell which part of the copy and view paths a wrong result comes from. On the GPU
# machine, after bench/torch/run.sh installed the wheel (or with WHEEL=path):
#
#   bench/torch/identity.sh OUT_DIR
#
# Writes OUT_DIR/identity-switches.json (one entry per setting: the switches, the
# learned run's losses and checks, the resident losses) and prints one line per setting.
set -u
out=${1:?usage: bench/torch/identity.sh OUT_DIR}
mkdir -p "$out"
[ -n "${WHEEL:-}" ] && python3 -m pip install --no-deps --no-index --force-reinstall "$WHEEL" >/dev/null
args=${IDENTITY_ARGS:---attn eager --parts train --skip fsdp2 on_demand --train-steps 3}
budget=${IDENTITY_TIME_S:-540}
t0=$SECONDS
: > "$out/identity-switches.jsonl"
for setting in "" SPILLWAY_CUDA_SYNC_RELEASES=1 SPILLWAY_CUDA_COPY_RUNS=0 SPILLWAY_CUDA_VIEWS=mapped \
        "SPILLWAY_CUDA_COPY_RUNS=0 SPILLWAY_CUDA_VIEWS=mapped SPILLWAY_CUDA_SYNC_RELEASES=1"; do
    if [ $((SECONDS - t0)) -gt "$budget" ]; then
        echo "{\"switches\": \"$setting\", \"skipped\": \"time\"}" >> "$out/identity-switches.jsonl"
        continue
    fi
    # shellcheck disable=SC2086
    env $setting timeout 150 python3 bench/torch/bench_torch.py $args --out "$out/one.json" \
        > "$out/one.out" 2> "$out/one.err"
    rc=$?
    SETTING="$setting" RC=$rc ONE="$out/one.json" ERR="$out/one.err" python3 - >> "$out/identity-switches.jsonl" <<'PY'
import json, os
e = {"switches": os.environ["SETTING"], "rc": int(os.environ["RC"])}
try:
    d = json.load(open(os.environ["ONE"]))
    tl = d["train"].get("learned", {})
    e.update({k: tl.get(k) for k in ("losses", "losses_equal", "grads_equal", "weights_equal",
                                      "first_loss_differing", "step_s", "hit_rate")})
    e["resident_losses"] = d["train"].get("resident", {}).get("losses")
    e["args"] = d["args"]
except Exception as x:
    e["error"] = f"{type(x).__name__}: {x}"
    e["stderr_tail"] = open(os.environ["ERR"]).read()[-2000:]
print(json.dumps(e))
PY
    rm -f "$out/one.json"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/identity-switches.jsonl")]
json.dump(rows, open(f"{sys.argv[1]}/identity-switches.json", "w"), indent=1)
for r in rows:
    ok = all(r.get(k) for k in ("losses_equal", "grads_equal", "weights_equal"))
    print(f"{r['switches'] or '(defaults)':<80} "
          + ("skipped" if "skipped" in r else "error: " + r["error"] if "error" in r else
             ("bit-identical" if ok else f"differs (first loss step {r.get('first_loss_differing')})")))
PY
rm -f "$out/identity-switches.jsonl" "$out/one.out" "$out/one.err"
