# Network namespaces for the multi-host tests on one machine (sourced, not run).
# Hosts are namespaces TAG-h1..TAG-hN, each with eth0 at 10.77.0.I/24 on a bridge that
# lives in a namespace of its own (TAG-br), so nothing touches this machine's interfaces.
# Used by scripts/launch-netns-test.sh and ops/slurm/run-netns-slurm.sh. Needs root.

# netns_up TAG N: the bridge and N hosts on it.
netns_up() {
    local tag=$1 hosts=$2 i ns
    ip netns add "$tag-br"
    ip -n "$tag-br" link add br0 type bridge
    ip -n "$tag-br" link set br0 up
    for i in $(seq 1 "$hosts"); do
        ns="$tag-h$i"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$tag-br"
        ip -n "$ns" addr add "10.77.0.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$tag-br" link set "p$i" master br0
        ip -n "$tag-br" link set "p$i" up
    done
}

# netns_down TAG N: kills what runs in the hosts and removes every namespace of netns_up;
# safe to call on a partial set-up (for an EXIT trap).
netns_down() {
    local tag=$1 hosts=$2 i
    for i in $(seq 1 "$hosts"); do
        ip netns pids "$tag-h$i" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$tag-h$i" 2>/dev/null || true
    done
    ip netns del "$tag-br" 2>/dev/null || true
}
