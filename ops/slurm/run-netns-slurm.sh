#!/usr/bin/env bash
# A real Slurm of 2 hosts on this machine: each host a network namespace on a bridge
# (10.77.0.1-2/24 only; removed on every way out), slurmctld and slurmd node1 in the
# first, slurmd node2 in the second (Debian's slurm-wlm and munge, started by hand). Then
#   srun -N2 -n4 spillway launch -- spillway demo ...
# 2 ranks per host: local rank 0 starts the host's node, rank 1 waits for it; each rank's
# demo client verifies every page, its pages spilled to the other host's node. Slurm's
# node names are not DNS names: launch asks `scontrol` for their NodeAddr. Needs root.
#   ops/slurm/run-netns-slurm.sh [path/to/spillway]   (default target/release/spillway)
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(realpath "${1:-target/release/spillway}")
. ops/slurm/lib.sh
. scripts/lib/netns.sh
slurm_install
tag="spws$$"
work=$(mktemp -d /tmp/spillway-slurm2.XXXXXX)
chmod 755 "$work"
conf=$work/slurm.conf
cleanup() {
    stop_pidfiles "$work"/*.pid
    netns_down "$tag" 2
    if [ "${KEEP_TMP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

netns_up "$tag" 2
# nsenter, not `ip netns exec`: the latter mounts a fresh /sys without the cgroup mounts
# slurmd needs; entering only the network namespace keeps this machine's.
in1() { nsenter --net="/run/netns/$tag-h1" "$@"; }
in2() { nsenter --net="/run/netns/$tag-h2" "$@"; }

munge_start "$work"
slurm_conf "$work" spillway-netns "$(hostname -s)(10.77.0.1)" "spool-%n" "-%n" \
    "NodeName=node[1-2] NodeAddr=10.77.0.[1-2] CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP" > "$conf"
mkdir -p "$work/state" "$work/spool-node1" "$work/spool-node2"
export SLURM_CONF=$conf
in1 slurmctld -f "$conf"
in1 slurmd -f "$conf" -N node1
in2 slurmd -f "$conf" -N node2
slurm_wait_idle 2 in1

out=$work/out
mkdir -p "$out"
in1 srun -N2 -n4 --ntasks-per-node=2 --chdir "$work" --export=ALL \
    "$exe" launch --dir "$work/pool" --run-base "$work/run" --host-budget 256MiB \
    --timeout-s 90 -- \
    sh -c '"$0" demo --layers 8 --weight-mib 2 --act-mib 1 --steps 2 --host-budget 8MiB \
        --json --out "$1/demo-$SLURM_PROCID.d" > "$1/demo-$SLURM_PROCID.json" \
        && echo "rank $SLURM_PROCID (local $SLURM_LOCALID) on $SLURMD_NODENAME: demo done, node $SPILLWAY_NODE_ID at $SPILLWAY_STATUS_ADDR"' \
        "$exe" "$out" 2>&1 | grep -v '^demo: steps\|^wrote ' | tee "$work/srun.log"
OUT="$out" python3 - <<'PY'
import json, os
for r in range(4):
    d = json.load(open(f"{os.environ['OUT']}/demo-{r}.json"))
    assert d["corrupt_pages"] == 0, d
    assert d["verified_bytes"] >= d["working_set_bytes"] * len(d["steps"]), d
    out = sum(s["remote_bytes_out"] for s in d["steps"])
    assert out > 0, "no page left the host"
    print(f"rank {r}: verified {d['verified_bytes']} B of a {d['working_set_bytes']} B working set "
          f"over {len(d['steps'])} steps, 0 corrupt, {out} B to the other host, total {d['total_s']:.2f} s")
PY
echo "srun -N2 -n4 spillway launch (2 network namespaces): passed"
