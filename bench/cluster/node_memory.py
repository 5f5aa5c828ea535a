#!/usr/bin/env python3
"""Memory honesty of loaded nodes: each node's peak resident memory (VmHWM, which counts
its code, its heap and the clients' shared memory it maps) against what it was configured
to hold: its host budget, plus the host tiers its local clients asked for (shared memory
the node maps; each client's own budget), plus the node's fixed overhead
(spillway_node::memory::NODE_BASE_OVERHEAD_BYTES, 32 MiB).

A pool of 3 node processes on loopback (`spillway cluster up`), host budget H each, and
demo clients in daemon mode whose working sets fill the peers' host tiers:

- `peers-full`: one client on node 1 (the default demo: 288 MiB working set, 48 MiB host
  tier), so nodes 2 and 3 hold node 1's pages up to their budgets;
- `client-and-peers`: clients on nodes 1 and 2 at once (144 MiB working sets, H/2 host
  tiers each), so nodes 1 and 2 map a client's host tier and hold the other's pages.

Prints a table, writes JSON (--out), and exits 1 if any node's
VmHWM / (host budget + its clients' host tiers + overhead) is above --max-ratio (1.05).

    bench/cluster/node_memory.py [--bin target/release/spillway] [--host-budget-mib 128]
                                 [--out bench/out/node_memory.json]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MIB = 1 << 20
# spillway_node::memory::NODE_BASE_OVERHEAD_BYTES and HOST_BUDGET_SLACK.
BASE_OVERHEAD_BYTES = 32 * MIB
SLACK = 1.05


def proc_status(pid):
    """VmHWM, VmRSS, RssShmem of a process, bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssShmem", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def store_used(metrics_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status", timeout=2) as r:
        return json.load(r)["host_tier"]["used_bytes"]


def run_scenario(bin_path, name, budget, clients, base_port):
    """Starts a pool, runs `clients` [(node, demo args)] at once, returns per-node figures."""
    d = tempfile.mkdtemp(prefix=f"spillway-mem-{name}-")
    subprocess.run(
        [bin_path, "cluster", "up", "--nodes", "3", "--dir", d, "--base-port", str(base_port),
         "--host-budget", f"{budget // MIB}MiB"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = [int(open(f"{d}/node-{n}/node.pid").read()) for n in (1, 2, 3)]
        used_max = [0, 0, 0]
        done = threading.Event()

        def sample():
            while not done.is_set():
                for i in range(3):
                    try:
                        used_max[i] = max(used_max[i], store_used(base_port + 1 + 2 * i))
                    except OSError:
                        pass
                done.wait(0.2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        procs = [subprocess.Popen(
            [bin_path, "demo", "--connect", f"{d}/node-{node}/client.sock", "--steps", "6",
             "--compute-passes", "2", "--json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node, args in clients]
        demos = []
        for p in procs:
            out, err = p.communicate()
            errors = sum(1 for l in err.splitlines() if " ERROR " in l)
            r = json.loads(out) if p.returncode == 0 and out.strip() else {}
            demos.append({"exit": p.returncode, "error_lines": errors,
                          "corrupt_pages": r.get("corrupt_pages"),
                          "host_budget_bytes": r.get("host_budget_bytes"),
                          "working_set_bytes": r.get("working_set_bytes")})
        done.set()
        sampler.join()
        nodes = []
        for i, pid in enumerate(pids):
            s = proc_status(pid)
            clients_bytes = sum(dm["host_budget_bytes"] or 0
                                for (node, _), dm in zip(clients, demos) if node == i + 1)
            denom = budget + clients_bytes + BASE_OVERHEAD_BYTES
            nodes.append({
                "node": i + 1, "host_budget_bytes": budget,
                "clients_host_bytes": clients_bytes,
                "base_overhead_bytes": BASE_OVERHEAD_BYTES,
                "vm_hwm_bytes": s["VmHWM"], "vm_rss_end_bytes": s["VmRSS"],
                "store_used_max_bytes": used_max[i],
                "ratio": s["VmHWM"] / denom,
            })
        return {"scenario": name, "nodes": nodes, "demos": demos}
    finally:
        subprocess.run([bin_path, "cluster", "down", "--dir", d],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", d])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/spillway")
    ap.add_argument("--host-budget-mib", type=int, default=128)
    ap.add_argument("--max-ratio", type=float, default=SLACK)
    ap.add_argument("--out", default="bench/out/node_memory.json")
    ap.add_argument("--base-port", type=int, default=7960)
    a = ap.parse_args()
    budget = a.host_budget_mib * MIB
    half = f"{a.host_budget_mib // 2}MiB"
    scenarios = [
        ("peers-full", [(1, [])]),
        ("client-and-peers", [(1, ["--layers", "12", "--host-budget", half]),
                              (2, ["--layers", "12", "--host-budget", half])]),
    ]
    runs = [run_scenario(a.bin, name, budget, clients, a.base_port)
            for name, clients in scenarios]
    worst = max(n["ratio"] for r in runs for n in r["nodes"])
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, Linux {platform.release()}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "max_ratio": a.max_ratio, "worst_ratio": worst, "runs": runs,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"host budget {a.host_budget_mib} MiB per node; ratio = VmHWM / (host budget + "
          f"its clients' host tiers + {BASE_OVERHEAD_BYTES // MIB} MiB overhead)\n")
    print("| scenario | node | clients' host tiers MiB | store peak MiB | VmHWM MiB | "
          "RSS at end MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        for n in r["nodes"]:
            print(f"| {r['scenario']} | {n['node']} | {n['clients_host_bytes'] / MIB:.0f} | "
                  f"{n['store_used_max_bytes'] / MIB:.0f} | "
                  f"{n['vm_hwm_bytes'] / MIB:.0f} | {n['vm_rss_end_bytes'] / MIB:.0f} | "
                  f"{n['ratio']:.3f} |")
    for r in runs:
        for i, dm in enumerate(r["demos"]):
            print(f"{r['scenario']} client {i + 1}: exit {dm['exit']}, corrupt pages "
                  f"{dm['corrupt_pages']}, error lines {dm['error_lines']}")
    print(f"\nworst ratio {worst:.3f} (limit {a.max_ratio}); JSON: {a.out}")
    return 0 if worst <= a.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
