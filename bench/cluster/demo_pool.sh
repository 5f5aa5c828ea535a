#!/usr/bin/env bash
# The demo workload as a client process over a pool of 3 node processes on loopback, in
# daemon mode: the working set is 4x the client's GPU plus host budgets, so most pages
# live on the peers. Runs once per --compute-passes value (more compute per byte hides
# more of the network) and appends a table, written from the runs' JSON, to RESULTS.md.
#
#   bench/cluster/demo_pool.sh [RESULTS.md] [PASSES...]     (default: 2 16 32 64)
#
# TRANSPORT=ucx moves the pages between nodes over UCX (a binary built with
# `--features ucx`; UCX is kept on loopback with UCX_NET_DEVICES=lo unless set).
set -euo pipefail
cd "$(dirname "$0")/../.."
results=${1:-bench/RESULTS.md}
shift || true
passes=("$@")
[ ${#passes[@]} -gt 0 ] || passes=(2 16 32 64)
transport=${TRANSPORT:-quic}
if [ "$transport" = ucx ]; then
    export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_TLS=${UCX_TLS:-tcp,self}
fi
bin=./target/release/spillway
[ -x "$bin" ] || cargo build --release -q
dir=$(mktemp -d)
trap '"$bin" cluster down --dir "$dir" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
"$bin" cluster up --nodes 3 --dir "$dir" --base-port 7900 --transport "$transport" >/dev/null
out="$dir/runs.jsonl"
for p in "${passes[@]}"; do
    "$bin" demo --connect "$dir/node-1/client.sock" --compute-passes "$p" --steps 8 --json \
        | python3 -c "import json,sys; r=json.load(sys.stdin); r['compute_passes']=$p; print(json.dumps(r))" >> "$out"
done
prefix=""
[ "$transport" = quic ] || prefix="TRANSPORT=$transport "
RUNS="$out" TRANSPORT="$transport" CMD="${prefix}bench/cluster/demo_pool.sh $results ${passes[*]}" python3 - >> "$results" <<'PY'
import json, os, platform, datetime
runs = [json.loads(l) for l in open(os.environ["RUNS"])]
cores = os.cpu_count()
load = os.getloadavg()[0]
print(f"\n### Demo workload over a pool of 3 node processes (daemon mode), {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}\n")
print(f"Command: `{os.environ['CMD']}`\n")
print(f"Machine: {platform.node()}, {cores} cores, Linux {platform.release()}; load average (1 min) {load:.2f}\n")
r0 = runs[0]
ws, g, h = r0["working_set_bytes"], r0["gpu_budget_bytes"], r0["host_budget_bytes"]
print(f"Working set {ws >> 20} MiB = {ws / (g + h):.1f}x (GPU {g >> 20} MiB + host {h >> 20} MiB); 2 MiB pages; sim device; 8 steps; pages between nodes over {os.environ['TRANSPORT'].upper()}.\n")
print("| compute passes | hit rate, steps 2+ | stall s/step (2+) | wall s/step (2+) | from peers MiB/step | to peers MiB/step | corrupt pages | verified |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    st = r["steps"][1:]
    n = len(st)
    hits = sum(s["hits"] for s in st) / sum(s["acquires"] for s in st)
    print(f"| {r['compute_passes']} | {hits:.4f} | {sum(s['stall_s'] for s in st)/n:.3f} | {sum(s['wall_s'] for s in st)/n:.3f} | "
          f"{sum(s['remote_bytes_in'] for s in st)/n/2**20:.0f} | {sum(s['remote_bytes_out'] for s in st)/n/2**20:.0f} | {r['corrupt_pages']} | {r['verified_bytes'] >> 20} MiB |")
print("\nJSON per run (remote counters): `" + json.dumps([{"compute_passes": r["compute_passes"], "remote": r["remote"]} for r in runs]) + "`")
PY
echo "appended to $results"
