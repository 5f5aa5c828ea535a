"""Tests of the trace recorder (``python/spillway_trace.py``) and its demo models.

Runs with ``python -m unittest discover python/tests`` or ``pytest python/tests``; skipped
as a whole where PyTorch is not installed. Models are tiny so the file runs in seconds on
a CPU.
"""

from __future__ import annotations

import io
import json
import math
import sys
import tempfile
import time
import unittest
import unittest.mock
import warnings
from pathlib import Path
from typing import Any

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - depends on the machine
    raise unittest.SkipTest(f"PyTorch is not installed: {e}") from e

PYTHON_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYTHON_DIR))

import spillway_trace  # noqa: E402
import spillway_trace_demos as demos  # noqa: E402
from spillway_trace import Recorder, record  # noqa: E402

TRACES_DIR = PYTHON_DIR.parent / "bench" / "traces"

KNOWN = {"step", "buffer", "bytes", "phase", "compute_us"}
BUFFER_BYTES_MAX = 1 << 40


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Reads a trace and checks every rule of docs/TRACE.md, as the Rust parser does."""
    lines: list[dict[str, Any]] = []
    sizes: dict[str, tuple[int, int]] = {}
    last_step = -1
    accesses = 0
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            assert len(text.rstrip("\n").encode()) <= 64 << 10, f"line {n} too long"
            line = json.loads(text)
            assert isinstance(line, dict), f"line {n}: not an object"
            for key in line:
                assert key in KNOWN or key.startswith("_"), f"line {n}: unknown key {key}"
            for key, kind in (("step", int), ("bytes", int), ("buffer", str), ("phase", str)):
                assert key in line, f"line {n}: missing {key}"
                assert isinstance(line[key], kind) and not isinstance(line[key], bool), (
                    f"line {n}: {key} has the wrong type"
                )
            assert line["step"] >= 0 and 0 <= line["bytes"] <= BUFFER_BYTES_MAX, f"line {n}"
            assert len(line["buffer"].encode()) <= 256 and len(line["phase"].encode()) <= 64
            assert line["step"] >= last_step, f"line {n}: step went back"
            last_step = line["step"]
            if "compute_us" in line and line["compute_us"] is not None:
                us = line["compute_us"]
                assert isinstance(us, (int, float)) and math.isfinite(us), f"line {n}"
                assert 0 <= us <= 3.6e9, f"line {n}: compute_us {us}"
            if line["bytes"] > 0:
                accesses += 1
                assert line["buffer"], f"line {n}: empty buffer name"
                first = sizes.setdefault(line["buffer"], (line["bytes"], n))
                assert first[0] == line["bytes"], (
                    f"line {n}: {line['buffer']} changed size since line {first[1]}"
                )
            lines.append(line)
    assert accesses > 0, "no accesses"
    return lines


def accesses_by_step(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        if line["bytes"] > 0:
            steps.setdefault(line["step"], []).append(line)
    return steps


def phase_runs(accesses: list[dict[str, Any]]) -> list[str]:
    """Phases with backward and recompute merged, collapsed into runs: fwd, bwd, fwd, ..."""
    runs: list[str] = []
    for a in accesses:
        phase = "bwd" if a["phase"].startswith("bwd") else a["phase"]
        if not runs or runs[-1] != phase:
            runs.append(phase)
    return runs


TINY = {"vocab": 128, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "seq": 8}


class TempDirTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name)

    def tearDown(self) -> None:
        self._tmp.cleanup()


class DenseTest(TempDirTest):
    def test_lines_are_valid_and_each_step_runs_forward_then_backward(self) -> None:
        cfg = demos.DemoConfig(**TINY)
        path = self.dir / "dense.jsonl"
        counts = demos.run_demo(cfg, path, steps=3)
        lines = read_trace(path)

        markers = [line for line in lines if line["bytes"] == 0]
        self.assertEqual(
            [(m["step"], m["phase"], m["buffer"]) for m in markers],
            [(0, "step", ""), (1, "step", ""), (2, "step", "")],
        )
        self.assertEqual(counts["markers"], 3)
        # Each marker is the last line of its step.
        for i, line in enumerate(lines):
            if line["bytes"] == 0 and i + 1 < len(lines):
                self.assertEqual(lines[i + 1]["step"], line["step"] + 1)

        steps = accesses_by_step(lines)
        self.assertEqual(sorted(steps), [0, 1, 2])
        for accesses in steps.values():
            self.assertEqual(phase_runs(accesses), ["fwd", "bwd"])
            fwd = [a["buffer"] for a in accesses if a["phase"] == "fwd"]
            bwd = [a["buffer"] for a in accesses if a["phase"] == "bwd"]
            self.assertEqual(fwd[0], "embed")
            self.assertEqual(fwd[-1], "head")
            # Backward visits the modules in reverse.
            self.assertEqual(bwd, fwd[::-1])
            for a in accesses:
                self.assertIn("compute_us", a)
        # The same modules every step.
        order = [[a["buffer"] for a in s] for s in steps.values()]
        self.assertTrue(all(o == order[0] for o in order))
        for m in markers:
            self.assertNotIn("compute_us", m)

    def test_buffer_sizes_are_the_modules_own_parameter_bytes(self) -> None:
        torch.manual_seed(0)
        cfg = demos.DemoConfig(**TINY)
        model = demos.build_model(cfg)
        rec = Recorder(model, io.StringIO())
        modules = dict(model.named_modules())
        for name, size in rec.buffers.items():
            own = sum(p.nbytes for p in modules[name].parameters(recurse=False))
            self.assertEqual(size, own, name)
        expected = {n for n, m in modules.items() if list(m.parameters(recurse=False))}
        self.assertEqual(set(rec.buffers), expected)
        self.assertEqual(sum(rec.buffers.values()), sum(p.nbytes for p in model.parameters()))


class CheckpointTest(TempDirTest):
    def check_recompute(self, checkpointing: str) -> list[dict[str, Any]]:
        cfg = demos.DemoConfig(**TINY, checkpointing=checkpointing, micro_batches=2)
        path = self.dir / f"{checkpointing}.jsonl"
        demos.run_demo(cfg, path, steps=2)
        lines = read_trace(path)
        self.assertEqual(sum(1 for line in lines if line["bytes"] == 0), 2)
        for accesses in accesses_by_step(lines).values():
            # Two micro-batches, each forward then backward, within one step.
            self.assertEqual(phase_runs(accesses), ["fwd", "bwd", "fwd", "bwd"])
            per_phase: dict[str, dict[str, int]] = {}
            for a in accesses:
                counts = per_phase.setdefault(a["phase"], {})
                counts[a["buffer"]] = counts.get(a["buffer"], 0) + 1
            self.assertEqual(set(per_phase), {"fwd", "bwd", "bwd-recompute"})
            self.assertTrue(all(c == 2 for c in per_phase["fwd"].values()))
            self.assertEqual(per_phase["fwd"], per_phase["bwd"])
            # Exactly the checkpointed blocks' modules are recomputed, once per micro-batch.
            block_buffers = {b for b in per_phase["fwd"] if b.startswith("layers.")}
            self.assertEqual(set(per_phase["bwd-recompute"]), block_buffers)
            self.assertTrue(all(c == 2 for c in per_phase["bwd-recompute"].values()))
        return lines

    def test_non_reentrant_checkpoint_is_recorded_as_recompute(self) -> None:
        self.check_recompute("non-reentrant")

    def test_reentrant_checkpoint_is_recorded_as_recompute(self) -> None:
        self.check_recompute("reentrant")

    def test_fallback_backward_detection_gives_the_same_trace(self) -> None:
        def key(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
            return [(x["step"], x["buffer"], x["phase"]) for x in lines]

        with_task_id = key(self.check_recompute("non-reentrant"))
        saved = spillway_trace._HAS_TASK_ID
        spillway_trace._HAS_TASK_ID = False
        try:
            self.assertEqual(key(self.check_recompute("non-reentrant")), with_task_id)
            self.check_recompute("reentrant")
        finally:
            spillway_trace._HAS_TASK_ID = saved


def moe_stats(lines: list[dict[str, Any]]) -> list[tuple[int, float | None, set[Any]]]:
    """(step, share of expert accesses to experts unused the step before, experts)."""
    out = []
    previous: set[Any] | None = None
    for step, accesses in accesses_by_step(lines).items():
        chosen = [e for a in accesses if (e := demos.expert_of(a["buffer"])) is not None]
        share = None
        if previous is not None and chosen:
            share = sum(1 for e in chosen if e not in previous) / len(chosen)
        out.append((step, share, set(chosen)))
        previous = set(chosen)
    return out


class MoeTest(TempDirTest):
    def test_expert_buffers_per_chosen_expert_and_differ_between_steps(self) -> None:
        cfg = demos.DemoConfig(**dict(TINY, seq=2), batch=1, moe="mixed")
        path = self.dir / "moe.jsonl"
        demos.run_demo(cfg, path, steps=6)
        lines = read_trace(path)
        buffers = {line["buffer"]: line["bytes"] for line in lines if line["bytes"] > 0}
        module_experts = [b for b in buffers if ".experts." in b and ".expert" not in b[-9:]]
        fused_experts = [b for b in buffers if b.rsplit(".", 1)[-1].startswith("expert")]
        self.assertTrue(any(b.startswith("layers.0.ffn.experts.") for b in module_experts))
        self.assertTrue(any(b.startswith("layers.1.ffn.experts.expert") for b in fused_experts))
        # A fused expert's buffer is its slice of w1 and w2.
        d, f = TINY["d_model"], TINY["d_ff"]
        for b in fused_experts:
            self.assertEqual(buffers[b], (d * f + f * d) * 4, b)

        stats = moe_stats(lines)
        self.assertEqual(len(stats), 6)
        for step, share, experts in stats:
            self.assertLess(len(experts), 2 * cfg.n_experts, f"step {step} used every expert")
            if share is not None:
                self.assertGreaterEqual(share, 0.2, f"step {step}: {share:.0%} new experts")
        for accesses in accesses_by_step(lines).values():
            fwd = sorted(a["buffer"] for a in accesses if a["phase"] == "fwd")
            bwd = sorted(a["buffer"] for a in accesses if a["phase"] == "bwd")
            self.assertEqual(fwd, bwd)  # each expert run forward is run backward

    def test_only_called_modulelist_experts_are_recorded(self) -> None:
        torch.manual_seed(0)
        moe = demos.Moe(16, 32, n_experts=8, top_k=1, fused=False)
        out = io.StringIO()
        with record(moe, out, compute_time=False):
            x = torch.randn(1, 1, 16, requires_grad=True)
            moe(x).sum().backward()
        lines = [json.loads(t) for t in out.getvalue().splitlines()]
        called = {line["buffer"].split(".")[1] for line in lines if "experts" in line["buffer"]}
        self.assertEqual(len(called), 1)
        self.assertEqual(
            [line["phase"] for line in lines], ["fwd", "fwd", "fwd", "bwd", "bwd", "bwd"]
        )

    def test_fused_experts_are_auto_detected_and_selector_is_checked(self) -> None:
        torch.manual_seed(0)
        moe = demos.Moe(16, 32, n_experts=8, top_k=2, fused=True)
        # Auto-detection by num_experts finds the [8, 16, 32] parameters, not the router's
        # [8, 16] weight.
        rec = Recorder(
            moe, io.StringIO(), expert_selector=demos.select_fused_experts, num_experts=8
        )
        self.assertIn("experts.expert7", rec.buffers)
        self.assertIn("router", rec.buffers)
        self.assertNotIn("router.expert0", rec.buffers)

        bad = record(moe, io.StringIO(), expert_selector=lambda m, a: [99], num_experts=8)
        with bad, self.assertRaisesRegex(ValueError, "chose experts"):
            moe(torch.randn(4, 16))

        with self.assertRaisesRegex(ValueError, "need an expert_selector"):
            Recorder(moe, io.StringIO(), num_experts=8)
        with self.assertRaisesRegex(ValueError, "not in the model"):
            Recorder(
                moe,
                io.StringIO(),
                expert_selector=demos.select_fused_experts,
                num_experts=8,
                expert_modules=["nope"],
            )


class RecorderTest(TempDirTest):
    def test_manual_steps_and_tied_weights(self) -> None:
        class Tied(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(10, 4)
                self.mid = nn.Linear(4, 4)
                self.head = nn.Linear(4, 10, bias=False)
                self.head.weight = self.embed.weight

            def forward(self, t: torch.Tensor) -> torch.Tensor:
                return self.head(self.mid(self.embed(t)))

        model = Tied()
        path = self.dir / "tied.jsonl"
        with record(model, path) as rec:
            for _ in range(2):
                model(torch.tensor([1, 2])).sum().backward()
                rec.step()
            self.assertEqual(rec.current_step, 2)
        lines = read_trace(path)
        self.assertEqual(set(rec.buffers), {"embed", "mid"})
        seq = [(x["step"], x["buffer"], x["phase"]) for x in lines]
        one = ["embed", "mid", "embed", "embed", "mid", "embed"]
        phases = ["fwd"] * 3 + ["bwd"] * 3
        expected = []
        for step in range(2):
            expected += [(step, b, p) for b, p in zip(one, phases, strict=True)]
            expected.append((step, "", "step"))
        self.assertEqual(seq, expected)

    def test_compute_time_can_be_left_out(self) -> None:
        model = nn.Linear(3, 3)
        out = io.StringIO()
        with record(model, out, compute_time=False) as rec:
            model(torch.randn(2, 3)).sum().backward()
            rec.step()
        lines = [json.loads(t) for t in out.getvalue().splitlines()]
        self.assertEqual(
            [(x["buffer"], x["phase"]) for x in lines],
            [("model", "fwd"), ("model", "bwd"), ("", "step")],
        )
        self.assertTrue(all("compute_us" not in x for x in lines))

    def test_compute_time_measures_the_gap_to_the_next_access(self) -> None:
        model = nn.Linear(3, 3)
        out = io.StringIO()
        with record(model, out) as rec:
            model(torch.randn(2, 3))
            rec.step()
            time.sleep(0.02)
            model(torch.randn(2, 3))
        lines = [json.loads(t) for t in out.getvalue().splitlines()]
        self.assertEqual([x["phase"] for x in lines], ["fwd", "step", "fwd"])
        # The time across the marker belongs to the access before it.
        self.assertGreaterEqual(lines[0]["compute_us"], 20_000)
        self.assertNotIn("compute_us", lines[1])
        self.assertGreaterEqual(lines[2]["compute_us"], 0)

    def test_hooks_are_removed_on_close_and_limit_stops_recording(self) -> None:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with record(model, out, max_accesses=3) as rec:
                model(torch.randn(1, 2)).sum().backward()
                model(torch.randn(1, 2))
        self.assertEqual(rec.accesses, 3)
        self.assertEqual(len(out.getvalue().splitlines()), 3)
        self.assertTrue(any("recording stops" in str(w.message) for w in caught))
        model(torch.randn(1, 2))
        self.assertEqual(len(out.getvalue().splitlines()), 3)

    def test_cli_records_a_trace(self) -> None:
        path = self.dir / "cli.jsonl"
        args = [
            "demo-checkpoint",
            "--out",
            str(path),
            "--steps",
            "2",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--d-ff",
            "64",
            "--vocab",
            "128",
            "--seq",
            "8",
        ]
        with unittest.mock.patch("sys.stdout", new=io.StringIO()):
            self.assertEqual(spillway_trace.main(args), 0)
            self.assertEqual(spillway_trace.main(["stats", str(path)]), 0)
        lines = read_trace(path)
        self.assertIn("bwd-recompute", {x["phase"] for x in lines})


class ExampleTracesTest(unittest.TestCase):
    """The traces committed under bench/traces (see its README) follow the format."""

    def test_example_traces_are_valid(self) -> None:
        for name in ("dense", "checkpoint_accum", "moe"):
            path = TRACES_DIR / f"{name}.jsonl"
            if not path.exists():
                self.skipTest(f"{path} not present")
            lines = read_trace(path)
            steps = accesses_by_step(lines)
            self.assertTrue(4 <= len(steps) <= 8, name)
            total = sum({x["buffer"]: x["bytes"] for x in lines if x["bytes"]}.values())
            self.assertTrue(16 << 20 <= total <= 256 << 20, f"{name}: {total} bytes")
        moe = read_trace(TRACES_DIR / "moe.jsonl")
        for step, share, _ in moe_stats(moe):
            if share is not None:
                self.assertGreaterEqual(share, 0.2, f"moe step {step}")


if __name__ == "__main__":
    unittest.main()
