#!/usr/bin/env bash
# `spillway launch` across 4 hosts: 4 network namespaces on a bridge (10.77.0.1-4/24 only,
# in a namespace of their own, so nothing touches this machine's interfaces), one
# `spillway launch` per host with a Slurm-style environment (2 ranks per host), then a
# torchrun-style one (1 rank per host, only host 0's address known). Hosts 2-4 join host
# 1's node with the join tokens it leaves in the shared directory. Then the Kubernetes
# DaemonSet's own script per host, with the Secret ops/k8s/make-secret.sh makes (no shared
# directory; tokens from the Secret). The job is the demo
# client (`demo --connect "$SPILLWAY_SOCKET"`); each host's demo must verify every page,
# and each host's node must have moved pages to at least one other host.
# Needs root (ip netns). Namespaces are removed on every way out.
#
#   scripts/launch-netns-test.sh [path/to/spillway]     (default target/release/spillway)
set -euo pipefail
cd "$(dirname "$0")/.."
exe=$(realpath "${1:-target/release/spillway}")
. scripts/lib/netns.sh
hosts=4
tag="spw$$"
tmp=$(mktemp -d /tmp/spillway-netns.XXXXXX)

cleanup() {
    netns_down "$tag" "$hosts"
    if [ "${KEEP_TMP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

netns_up "$tag" "$hosts"

# The job of every rank: the demo client against the host's node, its JSON kept, then the
# node's /metrics (the pages it moved per peer).
job='set -e
out="$OUT_DIR/$PHASE-h$SPILLWAY_HOST_INDEX-r${RANK_ON_HOST:-0}"
"$EXE" demo --layers 8 --weight-mib 2 --act-mib 1 --steps 2 \
    --host-budget 8MiB --json --out "$out.d" > "$out.json"
for doc in metrics status; do
    python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(\"http://$SPILLWAY_STATUS_ADDR/$doc\", timeout=5).read().decode())" > "$out.$doc"
done'

check() { # phase, ranks per host
    OUT_DIR="$tmp" PHASE="$1" RANKS="$2" HOSTS="$hosts" python3 - <<'PY'
import json, os, re, glob
tmp, phase, ranks, hosts = os.environ["OUT_DIR"], os.environ["PHASE"], int(os.environ["RANKS"]), int(os.environ["HOSTS"])
for h in range(hosts):
    for r in range(ranks):
        base = f"{tmp}/{phase}-h{h}-r{r}"
        d = json.load(open(base + ".json"))
        assert d["corrupt_pages"] == 0, (base, d["corrupt_pages"])
        need = d["working_set_bytes"] * len(d["steps"])
        assert d["verified_bytes"] >= need, (base, d["verified_bytes"], need)
        out = sum(s["remote_bytes_out"] for s in d["steps"])
        assert out > 0, (base, "no page left the host")
        # Pages of this node's clients went to other hosts' nodes (node ids are host + 1).
        peers = {}
        for line in open(base + ".metrics"):
            m = re.match(r'spillway_remote_bytes_total\{peer="(\d+)",direction="spilled"\} (\d+)', line)
            if m:
                peers[int(m.group(1))] = peers.get(int(m.group(1)), 0) + int(m.group(2))
        crossed = {p: b for p, b in peers.items() if b > 0 and p != h + 1}
        assert crossed, (base, "no spilled bytes to another host", peers)
        # Hosts 2-4 joined host 0 with tokens: every host a member, up, the first 3 voting.
        members = sorted((m["id"], m["state"], m["raft"]) for m in json.load(open(base + ".status"))["members"])
        want = [(k, "up", "voter" if k <= 3 else "learner") for k in range(1, hosts + 1)]
        assert members == want, (base, members)
        print(f"{phase} host {h} rank {r}: verified {d['verified_bytes']} B, 0 corrupt, "
              f"remote out {out} B, spilled to nodes {sorted(crossed)}, "
              f"voters {[k for k, _, role in members if role == 'voter']}")
PY
}

# launch_in HOST LOG VAR=VALUE... [-- LAUNCH_ARG...]: `spillway launch` of the job in
# host HOST's namespace, in the background, with a clean environment and the VAR=VALUEs,
# its output in LOG; its pid goes to `pids`.
pids=()
launch_in() {
    local host=$1 log=$2 vars=() extra=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    extra=("$@")
    ip netns exec "$tag-h$host" env -i PATH="$PATH" HOME="$tmp" EXE="$exe" OUT_DIR="$tmp" \
        "${vars[@]}" "$exe" launch --dir "$tmp/pool" --run-base "$tmp/run" \
        --host-budget 256MiB --timeout-s 90 "${extra[@]}" -- sh -c "$job" > "$log" 2>&1 &
    pids+=($!)
}

# wait_all PHASE: waits for every launch in `pids`; if one failed, shows the tails of
# PHASE's logs and fails.
wait_all() {
    local fail=0 p
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    pids=()
    if [ "$fail" != 0 ]; then tail -n 30 "$tmp/$1"-*.log; exit 1; fi
}

echo "== slurm-style: SLURM_JOB_NODELIST=10.77.0.[1-$hosts], 2 ranks per host"
for i in $(seq 1 "$hosts"); do
    for r in 0 1; do
        launch_in "$i" "$tmp/slurm-h$i-r$r.log" PHASE=slurm RANK_ON_HOST=$r \
            SLURM_JOB_NODELIST="10.77.0.[1-$hosts]" SLURM_NNODES=$hosts \
            SLURM_NODEID=$((i - 1)) SLURM_LOCALID=$r SLURM_PROCID=$((2 * (i - 1) + r)) \
            SLURM_STEP_TASKS_PER_NODE="2(x$hosts)" SLURM_JOB_ID="$$" SLURM_STEP_ID=0
    done
done
wait_all slurm
check slurm 2

echo "== torchrun-style: MASTER_ADDR=10.77.0.1, RANK/WORLD_SIZE/GROUP_RANK (only host 0's address known)"
for i in $(seq 1 "$hosts"); do
    launch_in "$i" "$tmp/torch-h$i.log" PHASE=torch MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
        WORLD_SIZE=$hosts RANK=$((i - 1)) GROUP_RANK=$((i - 1)) LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        -- --job-key "torch-$$"
done
wait_all torch
check torch 1
echo "== k8s-style: the DaemonSet's script (ops/k8s/daemonset.yaml), the Secret of ops/k8s/make-secret.sh"
# Each host gets the Secret's files, its own state and run directories, HOST_IP and the
# ConfigMap's values; the pod's `sleep infinity` becomes the job, which also waits until
# every host's demo is done (the DaemonSet's nodes run with --no-barrier).
mkdir -p "$tmp/bin" && ln -sf "$exe" "$tmp/bin/spillway"
SPILLWAY="$exe" ops/k8s/make-secret.sh "$hosts" 1h > "$tmp/secret.yaml"
TMP="$tmp" HOSTS="$hosts" python3 - <<'PY'
import base64, os, yaml
tmp, hosts = os.environ["TMP"], int(os.environ["HOSTS"])
secret = yaml.safe_load(open(f"{tmp}/secret.yaml"))["data"]
ds = yaml.safe_load(open("ops/k8s/daemonset.yaml"))
script = ds["spec"]["template"]["spec"]["containers"][0]["args"][0]
assert script.rstrip().endswith("-- sleep infinity"), script[-80:]
script = (script.rstrip().removesuffix("sleep infinity") + 'sh -c "$JOB"\n')
for path, var in (("/etc/spillway/secret", "$POD/secret"), ("/var/lib/spillway", "$POD/state"),
                  ("/run/spillway", "$POD/run")):
    script = script.replace(path, var)
open(f"{tmp}/pod.sh", "w").write(script)
for h in range(1, hosts + 1):
    d = f"{tmp}/pod-{h}/secret"
    os.makedirs(d)
    for k, v in secret.items():
        open(f"{d}/{k}", "wb").write(base64.b64decode(v))
PY
all_hosts=$(seq -s, -f "10.77.0.%g" 1 "$hosts")
k8s_job="$job"'
touch "$OUT_DIR/k8s-done-$SPILLWAY_HOST_INDEX"
while [ "$(ls "$OUT_DIR"/k8s-done-* | wc -l)" -lt "$HOSTS" ]; do sleep 0.1; done'
for i in $(seq 1 "$hosts"); do
    ip netns exec "$tag-h$i" env -i PATH="$tmp/bin:$PATH" HOME="$tmp" EXE="$exe" OUT_DIR="$tmp" \
        PHASE=k8s HOSTS="$hosts" POD="$tmp/pod-$i" JOB="$k8s_job" HOST_IP="10.77.0.$i" \
        SPILLWAY_HOSTS="$all_hosts" SPILLWAY_PORT=7700 SPILLWAY_HOST_BUDGET=256MiB \
        SPILLWAY_LOG=info sh "$tmp/pod.sh" > "$tmp/k8s-h$i.log" 2>&1 &
    pids+=($!)
done
wait_all k8s
check k8s 1
# Only host 0's pod copied the CA key; every node key stayed in its own pod.
for i in $(seq 1 "$hosts"); do
    keys=$(find "$tmp/pod-$i" -path "$tmp/pod-$i/secret" -prune -o -name '*.key.pem' -printf '%f\n' \
        | sort | tr '\n' ' ')
    want="node-$i.key.pem "
    [ "$i" = 1 ] && want="ca.key.pem node-1.key.pem "
    [ "$keys" = "$want" ] || { echo "pod $i holds keys [$keys], want [$want]"; exit 1; }
done
echo "k8s-style: keys stayed on their hosts"
echo "launch across $hosts network namespaces: slurm-style, torchrun-style and k8s-style passed"
