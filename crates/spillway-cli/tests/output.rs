//! Black-box tests of what the `spillway` binary shows (issue 18): tables drawn for the
//! terminal (Markdown only in `--record`), no colour off a terminal, progress on stderr
//! with `--json` too, plots and JSON in the folder `--out` names, `replay --find-budget`
//! and the GPU peaks of `replay`.

use serde_json::Value;

mod common;
use common::{
    COMPARE_BUDGET_BYTES, COMPARE_MOE, SMALL, Scratch, assert_contains_all, read_json,
    spillway_ok as spillway, stdout_json, trace_path,
};

/// No Markdown and no colour codes: what a table drawn for a pipe looks like.
fn assert_terminal_table(stdout: &str) {
    assert!(!stdout.contains("|---"), "Markdown rule in:\n{stdout}");
    assert!(!stdout.contains("**"), "Markdown bold in:\n{stdout}");
    assert!(
        !stdout.contains('\u{1b}'),
        "colour codes off a terminal in:\n{stdout}"
    );
    assert!(
        stdout.contains('┆') && stdout.contains('╞'),
        "no drawn table in:\n{stdout}"
    );
}

/// `command` on the small model, its files in `dir` and its Markdown recorded there.
fn small_run_recorded(dir: &Scratch, command: &[&str]) -> std::process::Output {
    spillway(&[command, &dir.out_args(), &dir.record_args(), SMALL].concat())
}

#[test]
fn offload_draws_its_table_with_the_spread_and_records_markdown_only_to_the_file() {
    let dir = Scratch::new("offload-table");
    let out = small_run_recorded(&dir, &["bench", "offload", "--repeats", "1"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_terminal_table(&stdout);
    assert_contains_all(
        "the table",
        &stdout,
        &[
            "ratio min–max",
            "to GPU MiB/step",
            "1 repeats interleaved",
            "load average (1 min)",
        ],
    );
    let v = read_json(&dir.join("offload.json"));
    // The table's learned row carries the JSON's figures.
    let learned = v["variants"][4].clone();
    let row = stdout
        .lines()
        .find(|l| l.contains(" learned "))
        .expect("a learned row");
    let ratio = format!("{:.3}", learned["ratio_to_floor"].as_f64().unwrap());
    assert!(
        row.contains(&format!("{ratio}–{ratio}")),
        "{row} vs {learned}"
    );
    let md = dir.recorded();
    assert!(md.contains("|---|"), "{md}");
    assert!(md.contains("| learned |"), "{md}");
    assert!(md.contains("load average (1 min)"), "{md}");
}

#[test]
fn demo_json_reports_progress_on_stderr_and_writes_its_plot_where_told() {
    let dir = Scratch::new("demo-out");
    let out = spillway(
        &[
            &["demo", "--json", "--nodes", "1"][..],
            &dir.out_args(),
            SMALL,
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    for step in 1..=4 {
        assert!(
            stderr.contains(&format!("demo: steps {step}/4: ")),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains(&dir.join("demo.json").display().to_string()),
        "{stderr}"
    );
    let printed = stdout_json(&out);
    let written = read_json(&dir.join("demo.json"));
    assert_eq!(printed["steps"], written["steps"]);
    let svg = std::fs::read_to_string(dir.join("demo.svg")).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("stall (waiting for copies)"),
        "{svg}"
    );
    // One bar per step and part: 4 steps x (rest, stall), beside the legend's swatches.
    assert!(svg.matches("<rect").count() >= 8, "{svg}");
}

#[test]
fn a_run_without_out_writes_under_spillway_out_and_says_where() {
    let out = spillway(&[&["demo", "--nodes", "1"][..], SMALL].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("wrote spillway-out/demo-"))
        .unwrap_or_else(|| panic!("no 'wrote' line in {stderr}"));
    let rel = line["wrote ".len()..].split(' ').next().unwrap();
    let path = std::env::temp_dir().join(rel);
    let v = read_json(&path);
    assert_eq!(v["steps"].as_array().unwrap().len(), 4);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    // The per-step table: aligned columns, byte columns in one unit named under them.
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(!stdout.contains('\u{1b}'), "{stdout}");
    let units = stdout.lines().nth(2).unwrap();
    assert_eq!(
        units.split_whitespace().collect::<Vec<_>>(),
        ["MiB"; 5]
            .iter()
            .copied()
            .chain(["pages"])
            .collect::<Vec<_>>()
    );
}

#[test]
fn replay_compare_draws_a_table_with_both_gpu_peaks_and_plots_every_policy() {
    let dir = Scratch::new("replay-compare");
    let path = trace_path("moe.jsonl");
    let out = spillway(&[&["replay", &path][..], COMPARE_MOE, &dir.out_args()].concat());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_terminal_table(&stdout);
    let v = read_json(&dir.join("replay.json"));
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    for r in runs {
        let policy = r["policy"].as_str().unwrap();
        // The table's peak is the most over the repeats (the policy's figures in the JSON).
        let figures = v["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["policy"] == policy)
            .unwrap_or_else(|| panic!("no {policy} in the JSON's policies"));
        let peak = figures["gpu_bytes_peak"].as_u64().unwrap();
        assert!(r["gpu_bytes_peak"].as_u64().unwrap() <= peak);
        let row = stdout
            .lines()
            .find(|l| l.contains(&format!(" {policy} ")))
            .unwrap_or_else(|| panic!("no {policy} row in {stdout}"));
        // GPU peak in MiB, and as a share of the 16 MiB budget.
        assert!(
            row.contains(&format!("{:.1}", peak as f64 / (1 << 20) as f64)),
            "{row}"
        );
        assert!(
            row.contains(&format!(
                "{:.0}%",
                100.0 * peak as f64 / COMPARE_BUDGET_BYTES as f64
            )),
            "{row}"
        );
        // What the trace holds at once is the same for every policy, and at most the peak.
        assert_eq!(r["gpu_bytes_held_peak"], runs[0]["gpu_bytes_held_peak"]);
        assert!(r["gpu_bytes_held_peak"].as_u64().unwrap() <= peak);
    }
    let held = runs[0]["gpu_bytes_held_peak"].as_u64().unwrap();
    assert!(
        stdout.contains(&format!("the trace holds at most {}", fmt_mib(held))),
        "{stdout}"
    );
    let svg = std::fs::read_to_string(dir.join("replay.svg")).unwrap();
    assert_contains_all(
        "the plot",
        &svg,
        &[
            "on_demand",
            "clock",
            "learned",
            "Stall (waiting for copies) per step",
        ],
    );
}

/// `spillway_types::fmt_bytes` of a size of at least 1 MiB and under 1 GiB.
fn fmt_mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

#[test]
fn replay_held_peak_is_the_largest_buffer_in_pages() {
    let path = trace_path("dense.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let largest = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["bytes"].as_u64())
        .max()
        .unwrap();
    let page = 256u64 << 10;
    let dir = Scratch::new("replay-held");
    let out = spillway(
        &[
            &[
                "replay",
                &path,
                "--json",
                "--time-scale",
                "0.02",
                "--device",
                "sim",
            ][..],
            &dir.out_args(),
        ]
        .concat(),
    );
    let v = stdout_json(&out);
    assert_eq!(v["gpu_bytes_held_peak"], largest.div_ceil(page) * page);
}

/// `replay --find-budget` of `trace` on the simulated device, writing into `dir`.
fn find_budget<'a>(trace: &'a str, dir: &'a Scratch, args: &[&'a str]) -> Vec<&'a str> {
    [
        &["replay", trace, "--find-budget", "--device", "sim"][..],
        args,
        &dir.out_args(),
    ]
    .concat()
}

#[test]
fn replay_find_budget_answers_with_budgets_it_replayed() {
    let dir = Scratch::new("find-budget");
    let trace = trace_path("dense.jsonl");
    let out = spillway(&find_budget(
        &trace,
        &dir,
        &["--json", "--page-size", "1MiB", "--time-scale", "0.1"],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v = stdout_json(&out);
    let page = 1u64 << 20;
    let probes = v["probes"].as_array().unwrap();
    assert!(
        stderr.contains(&format!("replay --find-budget: replays {}: ", probes.len())),
        "{stderr}"
    );
    let whole = v["pages_bytes"].as_u64().unwrap();
    assert_eq!(
        probes[0]["gpu_budget_bytes"], whole,
        "the resident replay comes first"
    );
    let compute = v["compute_s"].as_f64().unwrap();
    assert_eq!(compute, probes[0]["step_s_median"].as_f64().unwrap());
    let at = |b: u64| {
        probes
            .iter()
            .find(|p| p["gpu_budget_bytes"] == b)
            .unwrap_or_else(|| panic!("{b} was not replayed: {v}"))
    };
    let hits = v["hits_budget_bytes"].as_u64().unwrap();
    let step = v["step_budget_bytes"].as_u64().unwrap();
    for b in [hits, step] {
        assert_eq!(b % page, 0);
        assert!(b <= whole);
    }
    assert!(at(hits)["hit_rate"].as_f64().unwrap() >= 0.99);
    assert!(at(step)["step_s_median"].as_f64().unwrap() <= compute * 1.05);
    // The dense trace's learned run hits with far less than every page.
    assert!(hits < whole, "{v}");
    assert!(probes.iter().all(|p| p["corrupt_pages"] == 0));
    assert_eq!(read_json(&dir.join("budget.json")), v);
}

#[test]
fn replay_find_budget_prints_its_table_and_answer() {
    let dir = Scratch::new("find-budget-table");
    let trace = trace_path("dense.jsonl");
    let out = spillway(&find_budget(
        &trace,
        &dir,
        &["--page-size", "4MiB", "--time-scale", "0.05"],
    ));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_terminal_table(&stdout);
    let v = read_json(&dir.join("budget.json"));
    let answer = stdout
        .lines()
        .find(|l| l.starts_with("learned needs a GPU budget of "))
        .unwrap_or_else(|| panic!("no answer in {stdout}"));
    let hits = v["hits_budget_bytes"].as_u64().unwrap();
    assert!(
        answer.contains(&format!("of {} (", fmt_mib(hits))),
        "{answer} vs {v}"
    );
    assert!(answer.contains("for 99% hits"), "{answer}");
    assert!(answer.contains("within 5% of the compute time"), "{answer}");
    // One row per replay.
    let rows = stdout.lines().filter(|l| l.starts_with('│')).count();
    assert_eq!(rows, v["probes"].as_array().unwrap().len() + 1, "{stdout}");
}

#[test]
fn bench_remote_draws_one_unit_and_records_markdown_with_its_json() {
    let dir = Scratch::new("remote");
    let out = spillway(
        &[
            &["bench", "remote", "--bytes", "16MiB"][..],
            &dir.record_args(),
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bench remote: TCP (1 and 8 connections), QUIC, 3 rounds of 16.0 MiB each"),
        "{stderr}"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_terminal_table(&stdout);
    assert!(stdout.contains("throughput GiB/s"), "{stdout}");
    assert!(
        !stdout.contains("GB/s") && !stdout.contains("MiB/s"),
        "{stdout}"
    );
    let md = dir.recorded();
    let json: Value = serde_json::from_str(
        md.lines()
            .find_map(|l| l.strip_prefix("JSON: `")?.strip_suffix('`'))
            .expect("the JSON line"),
    )
    .unwrap();
    let ratio = format!("{:.3}", json["quic_over_tcp"].as_f64().unwrap());
    let quic_row = stdout
        .lines()
        .find(|l| l.contains("QUIC (mutual TLS"))
        .unwrap();
    assert!(quic_row.contains(&ratio), "{quic_row} vs {ratio}");
    assert!(
        md.contains("| QUIC (mutual TLS, frames, checksums) | "),
        "{md}"
    );
    assert!(md.contains(&format!(" | {ratio} |")), "{md}");
}

#[test]
fn demo_records_its_steps_and_totals_as_markdown() {
    let dir = Scratch::new("demo-record");
    let out = small_run_recorded(&dir, &["demo", "--nodes", "1"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let md = dir.recorded();
    let v = read_json(&dir.join("demo.json"));
    assert!(md.contains("### Demo, "), "{md}");
    assert!(
        md.contains("| step | wall s | stall s | verify s | planning ms |"),
        "{md}"
    );
    assert!(md.contains(" | hits | hit % | to GPU MiB |"), "{md}");
    for s in v["steps"].as_array().unwrap() {
        let start = format!(
            "| {} | {:.3} | {:.3} | {:.3} |",
            s["step"],
            s["wall_s"].as_f64().unwrap(),
            s["stall_s"].as_f64().unwrap(),
            s["verify_s"].as_f64().unwrap(),
        );
        let row = md
            .lines()
            .find(|l| l.starts_with(&start))
            .unwrap_or_else(|| panic!("{start} not in {md}"));
        let hits = format!(" | {}/{} |", s["hits"], s["acquires"]);
        assert!(row.contains(&hits), "{hits} not in {row}");
    }
    // The totals and the time from start to end are the lines the terminal showed.
    for prefix in ["learned on sim", "s from start to end"] {
        let line = stdout
            .lines()
            .find(|l| l.contains(prefix))
            .unwrap_or_else(|| panic!("{prefix:?} not in {stdout}"));
        assert!(md.contains(line), "{line} not in {md}");
    }
}
