//! `spillway replay --compare`: the three policies against the trace's own floor, over
//! interleaved repeats (issue 12).
//!
//! - **Step time** is each step's wall time less the checksum checks (`verify_s`, the
//!   harness's proof that every byte is right, not the job's work) and less the time the
//!   stepping thread waited for a core (its run delay, as `bench offload`). Both stay in
//!   the JSON and the table as their own columns.
//! - **The floor** is a `resident` replay of the same trace in the same process: a GPU
//!   budget that holds every page, so after step 1 no page moves, run with the same
//!   verification and the same accounting. It is the trace's compute time as the replay
//!   really runs it (the compute loop, the pool's acquire and release, the step). Each
//!   policy's ratio is to the floor of the same repeat.
//! - **Repeats**: the set (resident and the three policies) runs `repeats` times
//!   (default 3), interleaved, the order rotating each repeat so that none always runs
//!   first; each policy reports the median and the min–max over repeats of its median
//!   step time over steps 2... The load average and the core count are recorded before and
//!   after; the result says the machine was busy when the load before was at least
//!   [`crate::repeats::BUSY_LOAD_PER_CORE`] per core (shared with the benches:
//!   [`crate::repeats`]).

use anyhow::{Context, Result};
use serde::Serialize;
use spillway_client::Policy;

use crate::repeats::{Spread, is_busy, load_notes};
use crate::replay::{ReplayConfig, ReplayReport};
use crate::report::{Load, Table, machine_description};
use crate::workload::{RunReport, StepOverhead, median};

/// The runs of one repeat, in the order of the first (later repeats rotate it).
pub const VARIANTS: [&str; 4] = ["resident", "learned", "on_demand", "clock"];

/// One variant's figures over every repeat (steps 2.. of each).
#[derive(Debug, Clone, Serialize)]
pub struct PolicyFigures {
    /// `resident`, `learned`, `on_demand` or `clock`.
    pub policy: String,
    /// Median over repeats of the repeat's median step time (wall less verification
    /// less run delay), seconds.
    pub step_s_median: f64,
    /// Least of the repeats' median step times.
    pub step_s_min: f64,
    /// Greatest of the repeats' median step times.
    pub step_s_max: f64,
    /// The same of the wall time (verification and run delay included), seconds.
    pub wall_s_median: f64,
    /// Median over repeats of the ratio of the step time to the repeat's floor.
    pub ratio_to_floor: f64,
    /// Least ratio over the repeats.
    pub ratio_min: f64,
    /// Greatest ratio over the repeats.
    pub ratio_max: f64,
    /// Median over repeats of the mean stall per step, seconds.
    pub stall_s_per_step: f64,
    /// Median verification time per step, seconds.
    pub verify_s_per_step: f64,
    /// Median run delay per step, seconds.
    pub run_delay_s_per_step: f64,
    /// Median per step of each part of the pool's own time.
    pub overhead: StepOverhead,
    /// Hits / acquires over every repeat.
    pub hit_rate: f64,
    /// Median host-to-device bytes per step.
    pub h2d_bytes_per_step: u64,
    /// Median device-to-host bytes per step.
    pub d2h_bytes_per_step: u64,
    /// Prefetched pages evicted before use, median over repeats of the whole run's.
    pub prefetch_wasted_pages: u64,
    /// Corrupt pages over every repeat (must be 0).
    pub corrupt_pages: u64,
    /// The most GPU memory the pool held in any repeat (bytes).
    pub gpu_bytes_peak: u64,
    /// The GPU budget the policy ran under (bytes).
    pub gpu_budget_bytes: u64,
}

/// The comparison.
#[derive(Debug, Clone, Serialize)]
pub struct CompareResult {
    /// The trace file.
    pub trace: String,
    /// Repeats of the whole set.
    pub repeats: usize,
    /// Median over repeats of the resident run's step time, seconds.
    pub floor_s: f64,
    /// Each repeat's floor.
    pub floors_s: Vec<f64>,
    /// The resident run.
    pub resident: PolicyFigures,
    /// The three policies, in [`Policy::ALL`]'s order.
    pub policies: Vec<PolicyFigures>,
    /// The machine.
    pub machine: String,
    /// The load before the first run.
    pub load_before: Load,
    /// The load after the last run.
    pub load_after: Load,
    /// Whether the load before was at least [`crate::repeats::BUSY_LOAD_PER_CORE`] per core.
    pub busy: bool,
    /// The last repeat's reports of the three policies (per step, for the plot).
    pub runs: Vec<ReplayReport>,
}

impl CompareResult {
    /// The figures of `policy` (or `resident`).
    pub fn policy(&self, name: &str) -> Option<&PolicyFigures> {
        std::iter::once(&self.resident)
            .chain(&self.policies)
            .find(|p| p.policy == name)
    }
}

fn later(r: &RunReport) -> impl Iterator<Item = &crate::workload::StepReport> {
    r.steps.iter().filter(|s| s.step >= 2)
}

fn med(r: &RunReport, f: impl Fn(&crate::workload::StepReport) -> f64) -> f64 {
    median(later(r).map(f).collect())
}

fn fold(name: &str, runs: &[&RunReport], floors: &[f64]) -> PolicyFigures {
    let steps: Vec<f64> = runs.iter().map(|r| med(r, |s| s.step_s())).collect();
    let ratios: Vec<f64> = steps
        .iter()
        .zip(floors)
        .map(|(s, f)| s / f.max(f64::MIN_POSITIVE))
        .collect();
    let all = |f: fn(&crate::workload::StepReport) -> f64| -> f64 {
        median(runs.iter().flat_map(|r| later(r).map(f)).collect())
    };
    let (hits, acquires) = runs
        .iter()
        .flat_map(|r| later(r))
        .fold((0, 0), |(h, a), s| (h + s.hits, a + s.acquires));
    let (step, ratio) = (Spread::of(&steps), Spread::of(&ratios));
    PolicyFigures {
        policy: name.into(),
        step_s_median: step.median,
        step_s_min: step.min,
        step_s_max: step.max,
        wall_s_median: median(runs.iter().map(|r| med(r, |s| s.wall_s)).collect()),
        ratio_to_floor: ratio.median,
        ratio_min: ratio.min,
        ratio_max: ratio.max,
        stall_s_per_step: median(
            runs.iter()
                .map(|r| {
                    let n = later(r).count().max(1);
                    later(r).map(|s| s.stall_s).sum::<f64>() / n as f64
                })
                .collect(),
        ),
        verify_s_per_step: all(|s| s.verify_s),
        run_delay_s_per_step: all(|s| s.run_delay_s),
        overhead: StepOverhead {
            planning_s: all(|s| s.overhead.planning_s),
            lock_wait_s: all(|s| s.overhead.lock_wait_s),
            view_s: all(|s| s.overhead.view_s),
            device_planning_s: all(|s| s.overhead.device_planning_s),
            device_lock_wait_s: all(|s| s.overhead.device_lock_wait_s),
            remaps: all(|s| s.overhead.remaps as f64) as u64,
        },
        hit_rate: if acquires == 0 {
            1.0
        } else {
            hits as f64 / acquires as f64
        },
        h2d_bytes_per_step: all(|s| s.h2d_bytes as f64) as u64,
        d2h_bytes_per_step: all(|s| s.d2h_bytes as f64) as u64,
        prefetch_wasted_pages: median(
            runs.iter()
                .map(|r| r.prefetch_wasted_pages as f64)
                .collect(),
        ) as u64,
        corrupt_pages: runs.iter().map(|r| r.corrupt_pages).sum(),
        gpu_bytes_peak: runs.iter().map(|r| r.gpu_bytes_peak).max().unwrap_or(0),
        gpu_budget_bytes: runs.first().map_or(0, |r| r.gpu_budget_bytes),
    }
}

/// The resident run's configuration: a GPU budget of every page of the trace.
pub fn resident_config(trace: &crate::trace::Trace, cfg: &ReplayConfig) -> ReplayConfig {
    let page = cfg.page_size.bytes();
    let pages: u64 = trace
        .buffers
        .iter()
        .map(|(_, b)| cfg.page_size.pages_for(*b))
        .sum();
    ReplayConfig {
        gpu_budget_bytes: Some(pages.max(1) * page),
        policy: Policy::Clock,
        ..cfg.clone()
    }
}

/// Runs resident and the three policies `repeats` times, interleaved; `run_one` replays
/// the trace under one configuration (the CLI's, over nodes or not), `progress` hears
/// of each run as it ends.
pub fn compare(
    trace: &crate::trace::Trace,
    name: &str,
    cfg: &ReplayConfig,
    repeats: usize,
    mut run_one: impl FnMut(&ReplayConfig) -> Result<ReplayReport>,
    mut progress: impl FnMut(&str),
) -> Result<CompareResult> {
    crate::repeats::check(repeats)?;
    let load_before = Load::now();
    let resident_cfg = resident_config(trace, cfg);
    let mut reports: std::collections::HashMap<&str, Vec<ReplayReport>> = Default::default();
    for repeat in 0..repeats {
        for v in crate::repeats::order(VARIANTS, repeat) {
            let c = match v {
                "resident" => resident_cfg.clone(),
                _ => ReplayConfig {
                    policy: v.parse().map_err(|e| anyhow::anyhow!("{e}"))?,
                    ..cfg.clone()
                },
            };
            let r = run_one(&c).with_context(|| format!("replaying {name} under {v}"))?;
            progress(&format!(
                "repeat {}/{repeats}: {v} {:.4} s/step",
                repeat + 1,
                med(&r.run, |s| s.step_s())
            ));
            reports.entry(v).or_default().push(r);
        }
    }
    let runs_of = |v: &str| -> Vec<&RunReport> { reports[v].iter().map(|r| &r.run).collect() };
    let floors: Vec<f64> = runs_of("resident")
        .iter()
        .map(|r| med(r, |s| s.step_s()))
        .collect();
    let resident = fold("resident", &runs_of("resident"), &floors);
    let policies = Policy::ALL
        .iter()
        .map(|p| fold(p.name(), &runs_of(p.name()), &floors))
        .collect();
    let runs = Policy::ALL
        .iter()
        .map(|p| reports[p.name()].last().expect("ran").clone())
        .collect();
    Ok(CompareResult {
        trace: name.into(),
        repeats,
        floor_s: median(floors.clone()),
        floors_s: floors,
        resident,
        policies,
        machine: machine_description(),
        busy: is_busy(&load_before),
        load_before,
        load_after: Load::now(),
        runs,
    })
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

/// One row per variant: step time and its spread, ratio to the floor, stall,
/// verification, the pool's own time, bytes moved.
pub fn table(r: &CompareResult) -> Table {
    let mut t = Table::new([
        "policy",
        "step ms (median)",
        "min-max",
        "/ floor (min-max)",
        "stall ms/step",
        "verify ms/step",
        "planning ms",
        "lock wait ms",
        "views ms",
        "device ms",
        "remaps",
        "hit rate",
        "moved MiB/step",
        "wasted prefetch pages",
        "corrupt",
        "GPU peak MiB",
        "GPU peak / budget",
    ]);
    for p in std::iter::once(&r.resident).chain(&r.policies) {
        let o = &p.overhead;
        t.row([
            p.policy.clone(),
            ms(p.step_s_median),
            format!("{}-{}", ms(p.step_s_min), ms(p.step_s_max)),
            format!(
                "{:.3} ({:.3}-{:.3})",
                p.ratio_to_floor, p.ratio_min, p.ratio_max
            ),
            ms(p.stall_s_per_step),
            ms(p.verify_s_per_step),
            ms(o.planning_s),
            ms(o.lock_wait_s),
            ms(o.view_s),
            ms(o.device_planning_s + o.device_lock_wait_s),
            o.remaps.to_string(),
            format!("{:.2}%", 100.0 * p.hit_rate),
            format!(
                "{:.1}",
                (p.h2d_bytes_per_step + p.d2h_bytes_per_step) as f64 / (1 << 20) as f64
            ),
            p.prefetch_wasted_pages.to_string(),
            p.corrupt_pages.to_string(),
            format!("{:.1}", p.gpu_bytes_peak as f64 / (1 << 20) as f64),
            format!(
                "{:.0}%",
                100.0 * p.gpu_bytes_peak as f64 / p.gpu_budget_bytes.max(1) as f64
            ),
        ]);
    }
    t
}

/// The lines under the table: the floor, the accounting, the load.
pub fn notes(r: &CompareResult) -> Vec<String> {
    let mut notes = vec![
        format!(
            "floor: the resident replay (every page on the GPU, same verification), {:.4} s/step (median of {} repeats, interleaved); ratios are to each repeat's own floor",
            r.floor_s, r.repeats
        ),
        "step ms: wall time less checksum verification (its own column) and less the time the loop waited for a core; medians over steps 2..".to_string(),
    ];
    notes.extend(load_notes(&r.load_before, &r.load_after, "step times"));
    notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::replay;
    use crate::replay::tests::{forward_trace, sim_config};

    #[test]
    fn compare_interleaves_repeats_against_a_resident_floor() {
        let _serial = crate::workload::tests::serial_timing();
        let buffers: Vec<usize> = (0..12).collect();
        let t = forward_trace(3, &buffers, 60000, 500);
        let cfg = sim_config();
        let mut order = Vec::new();
        let r = compare(
            &t,
            "synthetic",
            &cfg,
            2,
            |c| {
                order.push((c.policy, c.gpu_budget_bytes));
                replay(&t, "synthetic", c, |_| {})
            },
            |_| {},
        )
        .unwrap();
        // 2 repeats of 4 runs; the second starts where the first's second run did.
        assert_eq!(order.len(), 8);
        assert_eq!(order[0], (Policy::Clock, Some(12 * (64 << 10))));
        assert_eq!(order[4].0, Policy::Learned);
        assert_eq!(order[7], (Policy::Clock, Some(12 * (64 << 10))));
        assert_eq!(r.floors_s.len(), 2);
        assert_eq!(r.policies.len(), 3);
        assert_eq!(r.runs.len(), 3);
        // Resident moves nothing after step 1 and its ratio is 1 by construction.
        assert_eq!(r.resident.h2d_bytes_per_step, 0);
        assert!((r.resident.ratio_to_floor - 1.0).abs() < 1e-12);
        for p in &r.policies {
            assert_eq!(p.corrupt_pages, 0);
            assert!(p.verify_s_per_step > 0.0, "{p:?}");
            assert!(p.step_s_min <= p.step_s_median && p.step_s_median <= p.step_s_max);
            // Each step computes 12 x 0.5 ms of wall time: no step's wall time is shorter.
            assert!(p.wall_s_median >= 0.006, "{p:?}");
        }
        assert!(r.policy("on_demand").unwrap().h2d_bytes_per_step > 0);
        assert_eq!(table(&r).markdown().lines().count(), 2 + 4);
        let e = compare(&t, "x", &cfg, 0, |c| replay(&t, "x", c, |_| {}), |_| {}).unwrap_err();
        assert!(e.to_string().contains("--repeats"), "{e}");
    }
}
