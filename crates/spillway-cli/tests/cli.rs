//! Black-box tests of the `spillway` binary.

use std::process::Command;

mod common;
use common::{
    COMPARE_BUDGET_BYTES, COMPARE_MOE, SMALL, Scratch, assert_contains_all, f64s, read_json,
    spillway_command, spillway_err, spillway_ok, stdout_json, strs, trace_path,
};

fn spillway(args: &[&str]) -> std::process::Output {
    spillway_command(args).output().expect("run spillway")
}

#[test]
fn demo_json_has_every_field_and_verifies_every_page() {
    let v = stdout_json(&spillway_ok(&[&["demo", "--json"][..], SMALL].concat()));
    assert_eq!(v["device"], "sim");
    assert_eq!(v["page_bytes"], 256 << 10);
    let ws = v["working_set_bytes"].as_u64().unwrap();
    assert_eq!(ws, 16 << 20);
    assert!(
        v["gpu_budget_bytes"].as_u64().unwrap() * 3 <= ws,
        "the working set is at least 3x the budget"
    );
    assert_eq!(v["corrupt_pages"], 0);
    assert!(v["verified_bytes"].as_u64().unwrap() >= ws * 4);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    for s in steps {
        for key in ["step", "wall_s", "stall_s", "acquires", "hits"] {
            assert!(s.get(key).is_some(), "step lacks {key}: {s}");
        }
        assert_eq!(s["acquires"], 32);
    }
}

#[test]
fn a_one_step_demo_gives_no_hit_rate_from_step_2() {
    // Step 1 has nothing to learn from: one step has no rate from step 2 to report (it
    // said 100.00%).
    let mut args = vec!["demo", "--nodes", "1"];
    let mut small = SMALL.to_vec();
    let at = small
        .iter()
        .position(|a| *a == "--steps")
        .expect("SMALL sets --steps");
    small[at + 1] = "1";
    args.extend(small);
    let out = String::from_utf8(spillway_ok(&args).stdout).unwrap();
    assert!(
        out.contains("hit rate from step 2: none (one step)"),
        "{out}"
    );
}

#[test]
fn demo_diverge_flag_marks_the_step() {
    let v = stdout_json(&spillway_ok(
        &[&["demo", "--json", "--diverge-step", "3"][..], SMALL].concat(),
    ));
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps[2]["diverged"], true);
    assert_eq!(steps[2]["acquires"], 28);
    assert_eq!(v["corrupt_pages"], 0);
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, expected) in [
        (
            &["demo", "--page-size", "100KiB", "--device", "sim"][..],
            "power of two",
        ),
        (&["demo", "--policy", "lru"], "unknown policy"),
        (
            &["demo", "--gpu-budget", "0", "--device", "sim"],
            "gpu_budget_bytes",
        ),
    ] {
        let err = spillway_err(args);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    assert!(
        spillway_err(&["demo", "--device", "cuda", "--steps", "1"]).contains("--features cuda")
    );
}

/// Asking for UCX without it is a clear error: without the feature, one naming the
/// feature; with it but without the library, one naming the library (here: a path that
/// does not exist, through SPILLWAY_UCX_LIB).
#[test]
fn ucx_without_the_feature_or_the_library_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_spillway"))
        .args(["demo", "--transport", "ucx", "--steps", "1"])
        .env("SPILLWAY_UCX_LIB", "/nonexistent/libucp.so.0")
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .expect("run spillway");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "ucx") {
        assert!(err.contains("/nonexistent/libucp.so.0"), "{err}");
        assert!(err.contains("libucx0"), "{err}");
    } else {
        assert!(err.contains("--features ucx"), "{err}");
    }
    if !cfg!(feature = "ucx") {
        assert!(
            spillway_err(&["bench", "remote", "--transport", "ucx"]).contains("--features ucx")
        );
    }
}

#[test]
fn offload_bench_json_has_every_variant_with_its_spread_and_the_load() {
    let dir = Scratch::new("offload");
    let out = spillway_ok(
        &[
            &["bench", "offload", "--json", "--repeats", "2"][..],
            &dir.out_args(),
            SMALL,
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Progress on stderr with --json too: one line per run (5 variants x 2 repeats).
    assert!(
        stderr.contains("bench offload: runs 10/10: repeat 2/2"),
        "{stderr}"
    );
    let v = stdout_json(&out);
    assert_eq!(v["repeats"], 2);
    let floors = f64s(&v["floors_s"]);
    assert_eq!(floors.len(), 2);
    // serde_json reads floats to within an ulp: compare with a tolerance.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0);
    assert!(close(
        v["floor_s"].as_f64().unwrap(),
        (floors[0] + floors[1]) / 2.0
    ));
    let names = strs(&v["variants"], "name");
    assert_eq!(
        names,
        ["resident", "copy_only", "on_demand", "clock", "learned"]
    );
    for x in v["variants"].as_array().unwrap() {
        let ratios = f64s(&x["ratios"]);
        assert_eq!(ratios.len(), 2, "{x}");
        let (lo, hi) = (ratios[0].min(ratios[1]), ratios[0].max(ratios[1]));
        assert!(close(x["ratio_min"].as_f64().unwrap(), lo), "{x}");
        assert!(close(x["ratio_max"].as_f64().unwrap(), hi), "{x}");
        // The median of two is their mean.
        let median = x["ratio_to_floor"].as_f64().unwrap();
        assert!((median - (lo + hi) / 2.0).abs() < 1e-12, "{x}");
        // A step's time is its wall time less its run delay: never more than the wall.
        assert!(
            x["step_s_median"].as_f64().unwrap() <= x["wall_s_median"].as_f64().unwrap() + 1e-12
        );
        assert_eq!(x["step_s"].as_array().unwrap().len(), 2);
        assert_eq!(x["corrupt_pages"], 0);
    }
    // The floor is max(resident, copy_only): resident's ratio is at most 1.
    let resident = &v["variants"][0];
    assert!(resident["ratio_max"].as_f64().unwrap() <= 1.0 + 1e-12);
    let load = &v["load_before"];
    let cores = load["cores"].as_u64().unwrap();
    assert!(cores >= 1);
    assert_eq!(
        v["busy"].as_bool().unwrap(),
        load["load_1min"].as_f64().unwrap() >= 0.5 * cores as f64
    );
    assert!(v["load_after"]["load_1min"].as_f64().is_some());
    assert!(
        std::fs::read_to_string(dir.join("offload.svg"))
            .unwrap()
            .contains("<svg")
    );
    let written = read_json(&dir.join("offload.json"));
    assert_eq!(written["floors_s"], v["floors_s"]);
}

#[test]
fn replay_json_has_the_demo_fields_and_peak_gpu_bytes() {
    let path = trace_path("dense.jsonl");
    let v = stdout_json(&spillway_ok(&[
        "replay",
        &path,
        "--json",
        "--time-scale",
        "0.05",
        "--device",
        "sim",
    ]));
    assert_eq!(v["corrupt_pages"], 0);
    assert_eq!(v["steps"].as_array().unwrap().len(), 8);
    assert_eq!(v["accesses"], 432);
    let peak = v["gpu_bytes_peak"].as_u64().unwrap();
    assert!(peak > 0 && peak <= v["gpu_budget_bytes"].as_u64().unwrap());
    assert!(
        v["gpu_budget_bytes"].as_u64().unwrap() * 3
            <= v["working_set_bytes"].as_u64().unwrap() + 3 * (256 << 10)
    );
}

#[test]
fn replay_compare_runs_every_policy() {
    let path = trace_path("moe.jsonl");
    let v = stdout_json(&spillway_ok(
        &[&["replay", &path, "--json"][..], COMPARE_MOE].concat(),
    ));
    let policies = strs(&v["runs"], "policy");
    assert_eq!(policies, ["on_demand", "clock", "learned"]);
    for r in v["runs"].as_array().unwrap() {
        assert_eq!(r["gpu_budget_bytes"], COMPARE_BUDGET_BYTES);
        assert_eq!(r["corrupt_pages"], 0);
    }
}

#[test]
fn replay_of_a_malformed_trace_names_the_line() {
    let dir = Scratch::new("bad-trace");
    let cases = [
        (
            "bad_json.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 10, \"phase\": \"fwd\"}\n{not json\n",
            "line 2",
        ),
        (
            "negative.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": -5, \"phase\": \"fwd\"}\n",
            "line 1",
        ),
        (
            "resized.jsonl",
            "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 10, \"phase\": \"fwd\"}\n{\"step\": 0, \"buffer\": \"a\", \"bytes\": 11, \"phase\": \"bwd\"}\n",
            "line 2",
        ),
        ("empty.jsonl", "", "no accesses"),
    ];
    for (name, text, expect) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let err = spillway_err(&["replay", path.to_str().unwrap(), "--device", "sim"]);
        assert!(err.contains(expect), "{name}: {err}");
    }
    spillway_err(&["replay", "/nonexistent/trace.jsonl"]);
}

/// A size flag too large for its unit is refused, never wrapped (issue 13: `--act-mib
/// 17592186044417` is 2^64 + 1 MiB, which wrapped to 1 MiB and ran); so is a size past
/// 2^64 bytes (the parser does not saturate) and one past the flag's range.
#[test]
fn size_flags_beyond_their_range_are_refused_not_wrapped() {
    let cases: &[(&str, &str)] = &[
        ("--act-mib", "17592186044417"),
        ("--weight-mib", "17592186044417"),
        ("--gpu-budget", "17592186044417MiB"),
        ("--gpu-budget", "17TiB"),
        ("--gpu-budget", "16EiB"),
        ("--host-budget", "18446744073709551616"),
        ("--page-size", "18014398509481984064KiB"),
        ("--page-size", "128MiB"),
        ("--page-size", "2.5 parsecs"),
        // The deprecated spellings keep their ranges.
        ("--gpu-budget-mib", "17592186044417"),
        ("--host-budget-mib", "17592186044417"),
        // 2^54 + 64 KiB: shifted to bytes it wrapped to a valid 64 KiB page.
        ("--page-kib", "18014398509481984064"),
        ("--page-kib", "18014398509482048"),
        ("--layers", "1152921504606846976"),
    ];
    for (flag, value) in cases {
        let out = spillway(&["demo", "--steps", "1", "--device", "sim", flag, value]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} was accepted: {err}");
        assert!(
            err.contains(flag) && err.contains(value),
            "{flag} {value}: {err}"
        );
        assert!(out.stdout.is_empty(), "{flag} {value} ran");
    }
    for args in [
        &["bench", "offload", "--weight-mib", "17592186044417"][..],
        &["bench", "gpu-offload", "--page-kib", "18014398509482048"],
        &["bench", "gpu-offload", "--page-size", "1MiB"],
        &["replay", "x.jsonl", "--gpu-budget", "16EiB"],
        &["bench", "remote", "--page-size", "1PiB"],
        &["cluster", "init", "--host-budget", "99999999999999999999B"],
    ] {
        let err = spillway_err(args);
        assert!(err.contains(args[args.len() - 2]), "{args:?}: {err}");
    }
}

/// Every command, from `spillway --help` down: its path and its `--help` text.
fn every_command_help() -> Vec<(String, String)> {
    fn commands_of(help: &str) -> Vec<String> {
        help.lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_string)
            .collect()
    }
    let mut found = Vec::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let help = String::from_utf8(spillway_ok(&args).stdout).unwrap();
        let subs = commands_of(&help);
        for sub in &subs {
            let mut p = path.clone();
            p.push(sub.clone());
            todo.push(p);
        }
        if subs.is_empty() {
            found.push((path.join(" "), help));
        }
    }
    found
}

/// Issue 18: the flags every command shares are spelled the same wherever they appear,
/// with the same value name; no help shows an old spelling.
#[test]
fn every_command_spells_the_shared_flags_the_same() {
    let helps = every_command_help();
    let names: Vec<&str> = helps.iter().map(|(c, _)| c.as_str()).collect();
    for expected in [
        "demo",
        "replay",
        "node",
        "status",
        "bench offload",
        "bench gpu-offload",
        "bench remote",
        "cluster init",
        "cluster up",
        "cluster down",
        "cluster failover-bench",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }
    let shared = [
        "--gpu-budget",
        "--host-budget",
        "--page-size",
        "--transport",
        "--device",
        "--policy",
        "--json",
        "--dir",
    ];
    // Each shared flag's rendering (`--gpu-budget <SIZE>`), from the first help showing it.
    let mut rendering: std::collections::BTreeMap<&str, (String, String)> = Default::default();
    for (command, help) in &helps {
        for old in [
            "--gpu-budget-mib",
            "--host-budget-mib",
            "--page-kib",
            "--host-tier-bytes",
            "--page-bytes",
        ] {
            assert!(
                !help.contains(old),
                "`{command} --help` shows {old}:\n{help}"
            );
        }
        // Option lines: `      --flag <VALUE>  doc`; descriptions are indented further.
        for line in help.lines().filter_map(|l| l.strip_prefix("      --")) {
            let line = format!("--{line}");
            let flag = line.split([' ', '=']).next().unwrap().to_string();
            let flag = flag.as_str();
            let words: Vec<&str> = flag[2..].split('-').collect();
            // A flag about budgets, pages, sizes or one of the shared names is one of them.
            let related = words.iter().any(|w| {
                [
                    "budget",
                    "page",
                    "size",
                    "transport",
                    "device",
                    "policy",
                    "json",
                    "dir",
                ]
                .contains(w)
            });
            // Flags whose words match but that are no size: an action (`replay
            // --find-budget`) and a count of processes (`launch --local-world-size`).
            let action = ["--find-budget", "--local-world-size"].contains(&flag);
            assert!(
                !related || action || shared.contains(&flag),
                "`{command} --help` has {flag}, not one of {shared:?}"
            );
            if let Some(&name) = shared.iter().find(|s| **s == flag) {
                let shown = line.split("  ").next().unwrap().to_string();
                let (first, first_shown) = rendering
                    .entry(name)
                    .or_insert_with(|| (command.clone(), shown.clone()));
                assert_eq!(
                    &shown, first_shown,
                    "{name} reads differently in `{command}` and `{first}`"
                );
            }
        }
    }
    for size in ["--gpu-budget", "--host-budget", "--page-size"] {
        assert_eq!(rendering[size].1, format!("{size} <SIZE>"), "{rendering:?}");
    }
    assert_eq!(rendering["--dir"].1, "--dir <DIR>");
    assert_eq!(rendering.len(), shared.len(), "{rendering:?}");
}

/// The old spellings still work for one release: same meaning as before (`--gpu-budget-mib`
/// in MiB, `--page-kib` in KiB) and one deprecation note each on stderr.
#[test]
fn old_flag_spellings_still_work_with_a_note() {
    let out = spillway_ok(&[
        "demo",
        "--json",
        "--nodes",
        "1",
        "--layers",
        "8",
        "--weight-mib",
        "1",
        "--act-mib",
        "1",
        "--steps",
        "2",
        "--device",
        "sim",
        "--gpu-budget-mib",
        "4",
        "--page-kib",
        "256",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    let v = stdout_json(&out);
    assert_eq!(v["gpu_budget_bytes"], 4 << 20);
    assert_eq!(v["page_bytes"], 256 << 10);
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("deprecated")).collect();
    assert_eq!(
        notes,
        [
            "note: --gpu-budget-mib is deprecated and will be removed in the next release; \
             use --gpu-budget 4MiB",
            "note: --page-kib is deprecated and will be removed in the next release; use \
             --page-size 256KiB",
        ],
        "{err}"
    );
    // Old and new together is a contradiction clap names.
    assert!(
        spillway_err(&["demo", "--gpu-budget-mib", "4", "--gpu-budget", "4MiB"])
            .contains("cannot be used with")
    );

    // `cluster init --host-tier-bytes`: the nodes get the size, with a note.
    let dir = tempfile::tempdir().unwrap();
    let out = spillway_ok(&[
        "cluster",
        "init",
        "--dir",
        dir.path().to_str().unwrap(),
        "--nodes",
        "1",
        "--host-tier-bytes",
        "64MiB",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--host-tier-bytes is deprecated") && err.contains("--host-budget 64MiB"),
        "{err}"
    );
    let config = std::fs::read_to_string(dir.path().join("node-1.toml")).unwrap();
    assert!(config.contains("host_budget = 67108864"), "{config}");
}

/// Issue 18: a user error is one line, `error: ...`, stating its cause once, with no
/// backtrace even when the environment asks for one.
#[test]
fn a_user_error_is_one_line_without_a_backtrace() {
    for backtrace in ["1", "full"] {
        let out = Command::new(env!("CARGO_BIN_EXE_spillway"))
            .args(["replay", "/nonexistent.jsonl"])
            .env("RUST_BACKTRACE", backtrace)
            .env("RUST_LIB_BACKTRACE", backtrace)
            .output()
            .expect("run spillway");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(!err.to_lowercase().contains("backtrace"), "{err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].starts_with("error: "), "{err}");
        assert!(lines[0].contains("/nonexistent.jsonl"), "{err}");
        assert_eq!(
            lines[0].matches("No such file or directory").count(),
            1,
            "{err}"
        );
        assert!(out.stdout.is_empty());
    }
}

/// `spillway --help` states the demo's working set as the demo prints it (issue 18: it said
/// 3x, the default run prints 12.0x; 3x is `--nodes 1`).
#[test]
fn the_demo_summary_in_help_matches_the_demo() {
    let help = String::from_utf8(spillway(&["--help"]).stdout).unwrap();
    let line = help
        .lines()
        .find(|l| l.trim_start().starts_with("demo"))
        .unwrap();
    assert!(line.contains("12x the GPU budget"), "{line}");
    assert!(line.contains("3x with --nodes 1"), "{line}");
    // The default shape, one step each way: the header says the same ratios.
    for (nodes, ratio) in [("3", "(12.0x)"), ("1", "(3.0x)")] {
        let out = spillway_ok(&[
            "demo",
            "--nodes",
            nodes,
            "--steps",
            "1",
            "--layers",
            "24",
            "--weight-mib",
            "1",
            "--act-mib",
            "1",
            "--page-size",
            "256KiB",
            "--device",
            "sim",
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let header = stdout.lines().next().unwrap();
        assert!(header.contains(ratio), "--nodes {nodes}: {header}");
    }
}

/// A pool started with `cluster up` that is stopped on drop, whatever the test did.
struct UpPool(tempfile::TempDir);

impl Drop for UpPool {
    fn drop(&mut self) {
        let _ = spillway(&["cluster", "down", "--dir", self.0.path().to_str().unwrap()]);
    }
}

/// Issue 18: `cluster up` prints each node's client socket (what `demo --connect` takes,
/// as its help says) and the commands to try next.
#[test]
fn cluster_up_prints_the_client_socket_and_what_to_try_next() {
    let pool = UpPool(tempfile::tempdir().unwrap());
    let dir = pool.0.path().to_str().unwrap().to_string();
    let port = (41_000 + (std::process::id() % 500) * 4).to_string();
    let out = spillway_ok(&[
        "cluster",
        "up",
        "--dir",
        &dir,
        "--nodes",
        "1",
        "--base-port",
        &port,
        "--host-budget",
        "64MiB",
        "--timeout-s",
        "30",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let spec = read_json(&pool.0.path().join("cluster.json"));
    let socket = spec["nodes"][0]["client_socket"].as_str().unwrap();
    assert_contains_all(
        "its output",
        &stdout,
        &[
            &format!("spillway demo --connect {socket}"),
            &format!("spillway status --dir {dir}"),
            &format!("spillway cluster down --dir {dir}"),
        ],
    );
    let help = String::from_utf8(spillway(&["demo", "--help"]).stdout).unwrap();
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains("(`spillway cluster up` prints each node's, and the command to try)"),
        "{help}"
    );
}

/// The tables of README.md and docs/*.md render as tables (issue 18: a blank line cut
/// the README's command table, its `replay` row rendered as a stray line): each table's
/// rows are contiguous, under a header and a delimiter row, with as many cells as the
/// header. Cells are split at unescaped `|`, as GitHub's Markdown does (also in code).
#[test]
fn markdown_tables_are_whole() {
    fn cells(row: &str) -> Option<usize> {
        let row = row.trim();
        if row.len() < 2 || !row.starts_with('|') || !row.ends_with('|') || row.ends_with("\\|") {
            return None;
        }
        let mut pipes = 0;
        let mut after_backslash = false;
        for c in row.chars() {
            if c == '|' && !after_backslash {
                pipes += 1;
            }
            after_backslash = c == '\\' && !after_backslash;
        }
        Some(pipes - 1)
    }
    fn is_delimiter(row: &str) -> bool {
        let row = row.trim().trim_matches('|');
        !row.is_empty()
            && row.split('|').all(|c| {
                let c = c.trim().trim_start_matches(':').trim_end_matches(':');
                !c.is_empty() && c.chars().all(|ch| ch == '-')
            })
    }
    let root = format!("{}/../..", env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![format!("{root}/README.md")];
    for entry in std::fs::read_dir(format!("{root}/docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path.to_str().unwrap().to_string());
        }
    }
    let mut tables = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let mut in_code = false;
        let mut group: Vec<(usize, &str)> = Vec::new();
        let mut groups = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
            }
            if !in_code && line.trim_start().starts_with('|') {
                group.push((i + 1, line));
            } else if !group.is_empty() {
                groups.push(std::mem::take(&mut group));
            }
        }
        groups.extend((!group.is_empty()).then_some(group));
        for g in groups {
            let (first, header) = g[0];
            assert!(
                g.len() >= 2 && is_delimiter(g[1].1),
                "{file}:{first}: table rows without a header and delimiter row above them \
                 (a blank line cutting a table?): {header}"
            );
            let width = cells(header).unwrap_or_else(|| panic!("{file}:{first}: {header}"));
            for (n, row) in &g[1..] {
                assert_eq!(
                    cells(row),
                    Some(width),
                    "{file}:{n}: a row of another width than its header at line {first}: {row}"
                );
            }
            tables += 1;
        }
    }
    assert!(tables >= 1, "no table found in {files:?}");
}

/// A node config that lends nothing is refused by `--check`, naming the field (issue 13:
/// it passed, and `cluster up` waited 30 s for the node's capacity before failing).
#[test]
fn node_check_refuses_a_config_that_lends_nothing() {
    let dir = Scratch::new("lend");
    let path = dir.join("node.toml");
    let base =
        "node_id = 1\npool_dir = \"/pool\"\ndata_dir = \"/data\"\nhost_tier_bytes = 1073741824\n";
    std::fs::write(&path, format!("{base}lend_bytes = 0\n")).unwrap();
    let err = spillway_err(&["node", "--check", "--config", path.to_str().unwrap()]);
    assert!(err.contains("`lend_bytes`"), "{err}");
    assert!(err.contains(path.to_str().unwrap()), "{err}");
    // Without it, the node lends its whole host tier.
    std::fs::write(&path, base).unwrap();
    let out = spillway_ok(&["node", "--check", "--config", path.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("lend_bytes = 1073741824"));
}

/// Writes a trace of `buffers` buffers of `bytes` each, one access each, to `name`.
fn big_trace(dir: &Scratch, name: &str, buffers: usize, bytes: u64) -> String {
    use std::io::Write as _;
    let path = dir.join(name);
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    for i in 0..buffers {
        writeln!(
            f,
            "{{\"step\": 0, \"buffer\": \"b{i}\", \"bytes\": {bytes}, \"phase\": \"fwd\"}}"
        )
        .unwrap();
    }
    f.flush().unwrap();
    path.to_str().unwrap().to_string()
}

/// A trace that cannot fit fails at once with the sizes (issue 13: 300k buffers of
/// 64 KiB took 6.4 GB for 23 s before `out of host memory`).
#[test]
fn replay_of_a_trace_that_cannot_fit_fails_at_once_naming_the_sizes() {
    let dir = Scratch::new("big-trace");

    // The issue's trace against a host budget of 1 GiB.
    let path = big_trace(&dir, "300k.jsonl", 300_000, 64 << 10);
    let started = std::time::Instant::now();
    let err = spillway_err(&["replay", &path, "--device", "sim", "--host-budget", "1GiB"]);
    let took = started.elapsed();
    assert_contains_all(
        "the error",
        &err,
        &[
            "300000 buffers",
            "19660800000 bytes",
            "78643200000 bytes",
            "1073741824 bytes",
            "--host-budget",
        ],
    );
    assert!(took.as_secs() < 10, "took {took:?}");
    println!("300k x 64 KiB against a 1 GiB host budget: refused in {took:?}");

    // 64 buffers of 1 TiB with the default budgets: no machine has the memory.
    let path = big_trace(&dir, "huge.jsonl", 64, 1 << 40);
    let started = std::time::Instant::now();
    let err = spillway_err(&["replay", &path, "--device", "sim"]);
    let took = started.elapsed();
    assert!(err.contains("70368744177664 bytes"), "{err}");
    assert!(err.contains("available"), "{err}");
    assert!(took.as_secs() < 10, "took {took:?}");
    println!("64 x 1 TiB with default budgets: refused in {took:?}");
}

/// `spillway status` into a pipe whose reader is gone ends quietly (issue 13: `spillway
/// status | true` panicked with exit code 101): the status comes from a stand-in node
/// that answers only after the reader has closed, so the first line already meets the
/// broken pipe.
#[test]
fn printing_into_a_closed_pipe_ends_quietly() {
    use std::io::{Read as _, Write as _};
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::Stdio;

    for json in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mut args = vec!["status", "--node", &addr, "--timeout-ms", "10000"];
        if json {
            args.push("--json");
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_spillway"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run spillway");
        drop(child.stdout.take());
        let (mut conn, _) = listener.accept().unwrap();
        let mut request = [0u8; 1024];
        let _ = conn.read(&mut request).unwrap();
        let body = r#"{"node_id":1,"role":"leader","leader":1,"term":2,"members":[]}"#;
        write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        drop(conn);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "json {json}: {err}");
        assert!(!err.contains("Broken pipe"), "json {json}: {err}");
        assert!(
            out.status.success() || out.status.signal() == Some(13),
            "json {json}: {:?}",
            out.status
        );
    }
}
