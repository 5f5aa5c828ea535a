#!/usr/bin/env python3
"""A peer's death loses nothing (issue 14), checked on real processes.

Each scenario starts a pool of 4 `spillway node` processes on loopback
(`spillway cluster up`), runs `spillway demo --connect` as a client of one node with a
working set that puts pages on every peer, breaks the pool in the middle of a step, and
checks what the client saw and how the pool recovered:

  kill-holder   SIGKILL a peer holding pages (not the leader): every step finishes,
                0 corrupt pages, no lost buffer, re-replication complete within 30 s
  kill-leader   the same with the Raft leader killed (the client on another node)
  stop-peer     SIGSTOP a peer holding pages for 10 s, then SIGCONT
  replicas-1    replicas = 1 and a holder killed: the demo (--skip-lost) reports the
                buffers that had pages there as lost and finishes the others; no
                buffer without a page on the victim (the client's node's /placements,
                read with the demo paused just before the kill) is lost
  steady, steady-replicas-1
                no fault, replicas 2 and 1: the hit rate from step 2 (what the second
                copy costs; a measurement, run only when named: on a loaded machine the
                client's compute and the nodes share the cores)

    scripts/peer_death.py [--bin target/release/spillway] [--scenario NAME ...] [--json OUT]
                          [--device sim|cuda|auto]

The demo runs on the sim device unless --device says otherwise: the scenarios are about
the remote tier, and on a GPU machine `auto` would pick the GPU, whose kernels take
microseconds, so the loop would measure loopback QUIC rather than what a peer's death
costs.

Prints one line per scenario and exits non-zero when a check fails. Needs only the
binary (loopback ports from --base-port).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

NODES = 4
STEPS = 8
# The step after which the fault hits: the pool has learned the loop and every page has
# been spilled once.
FAULT_AFTER_STEP = 2
REPAIR_LIMIT_S = 30.0
STOP_S = 10.0
DEMO_LIMIT_S = 600.0
SCENARIOS = ("kill-holder", "kill-leader", "stop-peer", "replicas-1")
MEASUREMENTS = ("steady", "steady-replicas-1")


class Failed(Exception):
    pass


def status(addr, timeout=1.0):
    try:
        with urllib.request.urlopen(f"http://{addr}/status", timeout=timeout) as r:
            return json.load(r)
    except OSError:
        return None


def placements(addr, timeout=1.0):
    """The node's `/placements`: holder node id -> buffer ids of its clients' pages there."""
    try:
        with urllib.request.urlopen(f"http://{addr}/placements", timeout=timeout) as r:
            view = json.load(r)
    except OSError:
        return None
    by_holder = {}
    for holders in view["clients"].values():
        for holder, buffers in holders.items():
            by_holder.setdefault(int(holder), set()).update(buffers)
    return by_holder, view["truncated"]


def wait_for(what, cond, limit_s, every_s=0.1):
    """Polls `cond` until it returns a truthy value; raises Failed after `limit_s`."""
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            raise Failed(f"{what}: not within {limit_s:.0f} s")
        time.sleep(every_s)


class Pool:
    def __init__(self, binary, base_port, replicas):
        self.bin = binary
        self.dir = tempfile.mkdtemp(prefix="spillway-peer-death-")
        subprocess.run([binary, "cluster", "init", "--nodes", str(NODES), "--dir", self.dir,
                        "--base-port", str(base_port)], check=True, stdout=subprocess.DEVNULL)
        self.info = json.load(open(os.path.join(self.dir, "cluster.json")))
        for n in self.info["nodes"]:
            text = open(n["config"]).read()
            text, found = re.subn(r"(?m)^replicas = \d+$", f"replicas = {replicas}", text)
            if not found:  # top-level keys go before the first table
                head, sep, tail = text.partition("\n[")
                text = f"{head}\nreplicas = {replicas}\n{sep}{tail}"
            open(n["config"], "w").write(text)
        subprocess.run([binary, "cluster", "up", "--nodes", str(NODES), "--dir", self.dir], check=True,
                       stdout=subprocess.DEVNULL)

    def node(self, node_id):
        return next(n for n in self.info["nodes"] if n["id"] == node_id)

    def pid(self, node_id):
        return int(open(self.node(node_id)["pid_file"]).read().split()[0])

    def statuses(self, skip=()):
        return {n["id"]: status(n["metrics_addr"]) for n in self.info["nodes"] if n["id"] not in skip}

    def leader(self):
        for s in self.statuses().values():
            if s and s.get("leader"):
                return s["leader"]
        return None

    def holders(self, exclude):
        """Peers whose lent memory holds pages, as the directory (a live node's status)
        says, most bytes first."""
        for s in self.statuses().values():
            if s:
                held = [(m["used_bytes"], m["id"]) for m in s["members"]
                        if m["used_bytes"] > 0 and m["id"] not in exclude]
                return [i for _, i in sorted(held, reverse=True)]
        return []

    def under_replicated(self, skip):
        """Bytes below their replica count, as every live node reports them (None while
        a node does not answer)."""
        total = 0
        for s in self.statuses(skip).values():
            if s is None:
                return None
            total += s["remote"]["under_replicated_bytes"]
        return total

    def down(self):
        subprocess.run([self.bin, "cluster", "down", "--dir", self.dir],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hit_rate(report, first, last=None):
    """Hits per acquire over steps `first..=last` (1-based) of a demo report."""
    steps = report.get("steps", [])[first - 1:last]
    acquires = sum(s["acquires"] for s in steps)
    return round(sum(s["hits"] for s in steps) / acquires, 4) if acquires else None


def finish(demo, out):
    """Waits for the demo and returns its JSON report; raises Failed if it failed."""
    rest = demo.stderr.read()
    demo.wait(timeout=DEMO_LIMIT_S)
    out.seek(0)
    report = json.loads(out.read() or "{}")
    if demo.returncode != 0:
        raise Failed(f"demo exited {demo.returncode}: {rest.strip().splitlines()[-1:]}")
    return report


def run_scenario(binary, name, base_port, device="sim"):
    replicas = 1 if name.endswith("replicas-1") else 2
    pool = Pool(binary, base_port, replicas)
    result = {"scenario": name, "replicas": replicas}
    try:
        leader = wait_for("a leader", pool.leader, 30)[0]
        client = next(i for i in range(1, NODES + 1) if i != leader) if name == "kill-leader" else 1
        sock = pool.node(client)["client_socket"]
        cmd = [binary, "demo", "--connect", sock, "--steps", str(STEPS), "--device", device, "--json"]
        if name == "replicas-1":
            cmd.append("--skip-lost")
        out = tempfile.TemporaryFile("w+")
        demo = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
        if name.startswith("steady"):
            report = finish(demo, out)
            result.update(hit_rate_from_step_2=hit_rate(report, 2),
                          hit_rate_per_step=[hit_rate(report, i, i) for i in range(1, len(report["steps"]) + 1)],
                          stall_s_per_step=[round(s["stall_s"], 3) for s in report["steps"]],
                          wall_s_per_step=[round(s["wall_s"], 3) for s in report["steps"]],
                          corrupt_pages=report.get("corrupt_pages"), steps=len(report["steps"]))
            result["ok"] = report.get("corrupt_pages") == 0
            return result
        # The demo prints "demo: steps K/N: ..." on stderr after each step.
        for line in demo.stderr:
            if line.startswith(f"demo: steps {FAULT_AFTER_STEP}/"):
                break
        else:
            raise Failed(f"the demo ended before step {FAULT_AFTER_STEP}")
        snapshot = None
        if name == "replicas-1":
            # What the kill will take: the demo paused, the client's node lists which
            # buffers have a page on each holder once the moves in flight settle.
            os.kill(demo.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            snapshot = placements(pool.node(client)["metrics_addr"])
            while time.monotonic() - t0 < 10:
                time.sleep(0.5)
                again = placements(pool.node(client)["metrics_addr"])
                if again == snapshot:
                    break
                snapshot = again
            if snapshot is None or snapshot[1]:
                raise Failed(f"no complete /placements from node {client}: {snapshot}")
        if name == "kill-leader":
            victim = leader
        else:
            candidates = pool.holders(exclude={client, leader})
            if not candidates:
                raise Failed("no peer other than the leader holds pages")
            victim = candidates[0]
        result["victim"] = victim
        t_fault = time.monotonic()
        if name == "stop-peer":
            os.kill(pool.pid(victim), signal.SIGSTOP)
            time.sleep(STOP_S)  # the fault itself: the peer is paused this long
            os.kill(pool.pid(victim), signal.SIGCONT)
        else:
            os.kill(pool.pid(victim), signal.SIGKILL)
        if snapshot is not None:
            os.kill(demo.pid, signal.SIGCONT)
        report = finish(demo, out)
        steps = len(report.get("steps", []))
        lost = report.get("lost_buffers", [])
        result.update(steps=steps, corrupt_pages=report.get("corrupt_pages"),
                      hit_rate_before_fault=hit_rate(report, 2, FAULT_AFTER_STEP),
                      lost_buffers=len(lost), verified_bytes=report.get("verified_bytes"))
        if steps != STEPS:
            raise Failed(f"{steps} of {STEPS} steps")
        if report.get("corrupt_pages") != 0:
            raise Failed(f"{report.get('corrupt_pages')} corrupt pages")
        if name == "replicas-1":
            if not lost:
                raise Failed("replicas = 1 and a holder killed, yet no buffer reported lost")
            # Lost: only buffers with a page on the victim. A buffer there whose pages
            # the client still had in its own tiers, and wrote again before they left
            # (the activations it writes first when it resumes), is not lost: the
            # victim's copies were stale by then.
            on_victim = snapshot[0].get(victim, set())
            lost_ids = set(report.get("lost_buffer_ids", []))
            result.update(buffers_on_victim=len(on_victim),
                          lost_not_on_victim=sorted(lost_ids - on_victim),
                          on_victim_not_lost=sorted(on_victim - lost_ids))
            if lost_ids - on_victim:
                raise Failed(f"buffers {sorted(lost_ids - on_victim)} lost with no page on node {victim}")
        elif lost:
            raise Failed(f"{len(lost)} buffers lost with replicas = {replicas}")
        if name != "replicas-1":
            skip = {} if name == "stop-peer" else {victim}
            _, took = wait_for("re-replication",
                               lambda: pool.under_replicated(skip) == 0, REPAIR_LIMIT_S)
            result["repaired_s_after_demo"] = round(took, 2)
            result["fault_to_repaired_s"] = round(time.monotonic() - t_fault, 2)
        result["ok"] = True
    except (Failed, subprocess.SubprocessError, ValueError) as e:
        result.update(ok=False, error=str(e), pool_dir=pool.dir)
    finally:
        pool.down()
    return result


def main():
    global NODES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/spillway")
    ap.add_argument("--scenario", nargs="*", default=list(SCENARIOS), choices=SCENARIOS + MEASUREMENTS)
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--nodes", type=int, default=NODES,
                    help=f"node processes in the pool (default {NODES}; the fault scenarios need 4)")
    ap.add_argument("--device", default="sim", choices=("sim", "cuda", "auto"),
                    help="the demo client's device (default sim: see above)")
    ap.add_argument("--json", help="write the results here as a JSON list")
    a = ap.parse_args()
    NODES = a.nodes
    results = []
    for i, name in enumerate(a.scenario):
        r = run_scenario(a.bin, name, a.base_port + 20 * i, a.device)
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    failed = [r["scenario"] for r in results if not r["ok"]]
    print(f"peer death: {len(results) - len(failed)} of {len(results)} scenarios passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
