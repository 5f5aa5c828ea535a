"""``python -m spillway_trace stats`` reads a trace with no PyTorch (issue 18): run in a
subprocess where ``import torch`` fails, on the example traces, its counts checked against
the files. Runs anywhere (``python3 -m unittest discover python/tests``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import unittest
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]
TRACES_DIR = PYTHON_DIR.parent / "bench" / "traces"

# Runs `python -m spillway_trace ARGS` with torch unimportable (None in sys.modules makes
# `import torch` raise ImportError).
NO_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['spillway_trace'] + sys.argv[1:]; "
    "runpy.run_module('spillway_trace', run_name='__main__')"
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args],
        cwd=PYTHON_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )


class StatsWithoutTorch(unittest.TestCase):
    def test_stats_counts_the_trace_without_importing_torch(self) -> None:
        path = TRACES_DIR / "dense.jsonl"
        lines = [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
        accesses = [a for a in lines if a["bytes"] > 0]
        steps = sorted({a["step"] for a in accesses})
        buffers = {a["buffer"]: a["bytes"] for a in accesses}
        out = run("stats", str(path))
        self.assertEqual(out.returncode, 0, out.stderr)
        first = out.stdout.splitlines()[0]
        self.assertEqual(
            first,
            f"{path}: {len(accesses)} accesses in {len(steps)} steps, "
            f"{len(lines) - len(accesses)} markers, {len(buffers)} buffers, "
            f"{sum(buffers.values()) / 2**20:.1f} MiB",
        )
        self.assertEqual(len(out.stdout.splitlines()), 1 + len(steps))

    def test_the_demo_models_say_they_need_torch_in_one_line(self) -> None:
        out = run("demo-dense", "--out", "/dev/null")
        self.assertEqual(out.returncode, 1)
        self.assertEqual(len(out.stderr.strip().splitlines()), 1, out.stderr)
        self.assertIn("need PyTorch (pip install torch)", out.stderr)
        self.assertIn("stats PATH` needs none", out.stderr)


if __name__ == "__main__":
    unittest.main()
