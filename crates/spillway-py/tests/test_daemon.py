"""Daemon mode: ``spillway.Pool.connect`` against a real node process.

The node is the ``spillway`` binary (``$SPILLWAY_BIN``, else the workspace's
``target/release/spillway``, which CI builds before these tests), started by
``spillway cluster up``, which returns once the node answers /status and is leader; the
tests then wait on the client socket itself, never on a sleep.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import spillway

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[3]
SPILLWAY_BIN = Path(os.environ.get("SPILLWAY_BIN", REPO / "target" / "release" / "spillway"))
NODE_START_TIMEOUT_S = 30


def free_port_pair():
    """A port P with P (UDP, the node's peers) and P+1 (TCP, its /status) free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 1 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, socket.socket() as t:
                u.bind(("127.0.0.1", port))
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def wait_for_socket(path, timeout_s):
    """Waits until something accepts connections on the Unix socket `path`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            # Poll the condition (the socket accepting); the node started seconds ago.
            time.sleep(0.01)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if not SPILLWAY_BIN.exists():
        pytest.skip(f"no spillway binary at {SPILLWAY_BIN} (cargo build --release, or set SPILLWAY_BIN)")
    pool_dir = tmp_path_factory.mktemp("pool")
    up = subprocess.run(
        [str(SPILLWAY_BIN), "cluster", "up", "--nodes", "1", "--dir", str(pool_dir),
         "--base-port", str(free_port_pair()), "--host-budget", "64MiB",
         "--timeout-s", str(NODE_START_TIMEOUT_S), "--log", "warn"],
        capture_output=True, text=True, timeout=NODE_START_TIMEOUT_S + 30,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    sock = pool_dir / "node-1" / "client.sock"
    try:
        wait_for_socket(sock, NODE_START_TIMEOUT_S)
        yield {"dir": pool_dir, "socket": sock}
    finally:
        subprocess.run([str(SPILLWAY_BIN), "cluster", "down", "--dir", str(pool_dir)],
                       capture_output=True, timeout=60)


def node_clients(pool_dir):
    out = subprocess.run([str(SPILLWAY_BIN), "status", "--dir", str(pool_dir), "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    doc = json.loads(out.stdout)
    return doc["nodes"][0]["status"]["clients"]


def test_connect_round_trips_through_the_shared_host_tier(node):
    p = spillway.Pool.connect(node["socket"], gpu_budget="4MiB", host_budget="32MiB",
                              device="sim")
    assert p.socket == node["socket"] and isinstance(p.client_id, int)
    assert "socket=" in repr(p)
    st = p.stats()
    assert st["host_budget_bytes"] == 32 * MiB and st["gpu_budget_bytes"] == 4 * MiB
    assert node_clients(node["dir"]) == 1
    rng = np.random.default_rng(7)
    want = [rng.integers(0, 256, 2 * MiB, dtype=np.uint8) for _ in range(6)]
    bufs = [p.alloc(f"w{i}", 2 * MiB) for i in range(6)]  # 12 MiB through 4 MiB of GPU
    for b, w in zip(bufs, want):
        with p.acquire_mut(b) as view:
            np.from_dlpack(view)[:] = w
    for b, w in zip(bufs, want):
        with p.acquire(b) as view:
            assert np.array_equal(np.from_dlpack(view), w)
        assert p.read(b, 0, 2 * MiB) == w.tobytes()
    st = p.stats()
    assert st["evictions_dirty"] > 0 and st["d2h_bytes"] > 0  # pages went to shared memory
    assert st["host_bytes"] == 12 * MiB
    del p, view


def test_two_clients_get_their_own_shared_memory(node):
    a = spillway.Pool.connect(node["socket"], gpu_budget="4MiB", host_budget="8MiB",
                              device="sim")
    b = spillway.Pool.connect(str(node["socket"]), gpu_budget="4MiB", host_budget="8MiB",
                              device="sim")
    assert a.client_id != b.client_id
    ba, bb = a.alloc("x", MiB), b.alloc("x", MiB)
    a.write(ba, 0, b"\x01" * MiB)
    b.write(bb, 0, b"\x02" * MiB)
    assert a.read(ba, 0, MiB) == b"\x01" * MiB and b.read(bb, 0, MiB) == b"\x02" * MiB


def test_connect_without_a_node_is_no_node_error(tmp_path):
    missing = tmp_path / "none.sock"
    with pytest.raises(spillway.NoNodeError) as e:
        spillway.Pool.connect(missing, gpu_budget="4MiB", host_budget="8MiB", device="sim")
    assert e.value.socket == str(missing)
    assert isinstance(e.value, ConnectionError) and "spillway node" in str(e.value)


def test_a_page_size_the_node_does_not_use_is_refused(node):
    with pytest.raises(spillway.NodeRefusedError) as e:
        spillway.Pool.connect(node["socket"], gpu_budget="4MiB", host_budget="8MiB",
                              page_size="1MiB", device="sim")
    assert e.value.code == "PageSizeMismatch"
