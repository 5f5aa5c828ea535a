//! `spillway replay --find-budget`: the smallest GPU budget at which the learned policy
//! reaches [`HIT_RATE_TARGET`] of hits (steps 2..), and the smallest at which its median
//! step time (steps 2..) is within [`STEP_SLACK`] of the compute time.
//!
//! The compute time is the trace's median step time (steps 2..) with a budget that holds
//! every page (nothing moves after step 1), measured first, in the same run. Each search
//! is a bisection over budgets in whole pages, from the most pages the trace holds at once
//! (no smaller budget can run it) to every page (the resident run, which meets both
//! targets by definition); it assumes more budget never makes a run worse, and every
//! replay it makes is kept ([`Probe`]) and reused by the other search. A bisection over
//! `n` pages replays the trace about `log2(n)` times per target; `--time-scale` shortens
//! each replay. Step times are noisy on a shared machine: the time target's answer moves
//! by a few pages from run to run where the step time is flat around the target.

use anyhow::{Result, bail};
use serde::Serialize;
use spillway_client::Policy;

use crate::replay::{ReplayConfig, replay};
use crate::trace::Trace;

/// The hit rate (steps 2..) a budget must reach: 99%.
pub const HIT_RATE_TARGET: f64 = 0.99;
/// How far above the compute time the median step time may be: 5%.
pub const STEP_SLACK: f64 = 0.05;

/// One replay of the search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Probe {
    /// The GPU budget tried.
    pub gpu_budget_bytes: u64,
    /// Hits / acquires over steps 2...
    pub hit_rate: f64,
    /// Median step time over steps 2.., seconds.
    pub step_s_median: f64,
    /// Corrupt pages seen (must be 0).
    pub corrupt_pages: u64,
}

/// What the search found.
#[derive(Clone, Debug, Serialize)]
pub struct BudgetSearch {
    /// The policy searched (learned).
    pub policy: String,
    /// The page size.
    pub page_bytes: u64,
    /// Every page of every buffer: the resident budget.
    pub pages_bytes: u64,
    /// Median step time (steps 2..) with every page resident, seconds.
    pub compute_s: f64,
    /// (slowest - fastest) / median of the resident replay's steps 2..: how much step
    /// times move at one budget on this machine. Above [`STEP_SLACK`], the step-time
    /// answer is within the noise.
    pub compute_spread: f64,
    /// [`HIT_RATE_TARGET`].
    pub hit_rate_target: f64,
    /// [`STEP_SLACK`].
    pub step_slack: f64,
    /// The smallest budget whose hit rate reached the target.
    pub hits_budget_bytes: u64,
    /// The smallest budget whose step time was within the slack of the compute time.
    pub step_budget_bytes: u64,
    /// Every replay made, in the order made (the resident one first).
    pub probes: Vec<Probe>,
}

/// Searches the budgets of `cfg` (its policy is set to learned, its GPU budget varied);
/// `progress` hears of each replay as it ends.
pub fn find_budget(
    trace: &Trace,
    name: &str,
    cfg: &ReplayConfig,
    mut progress: impl FnMut(&Probe),
) -> Result<BudgetSearch> {
    if trace.steps.len() < 2 {
        bail!(
            "--find-budget judges steps 2.., and the trace has {} step(s)",
            trace.steps.len()
        );
    }
    let page = cfg.page_size.bytes();
    let pages_total = trace.pages_total(cfg.page_size);
    let pages_least: u64 = trace
        .accesses
        .iter()
        .map(|a| cfg.page_size.pages_for(a.bytes))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut probes: Vec<Probe> = Vec::new();
    let (compute_s, compute_spread) = resident(
        trace,
        name,
        cfg,
        pages_total * page,
        &mut probes,
        &mut progress,
    )?;
    let mut probe = |pages: u64, probes: &mut Vec<Probe>| -> Result<Probe> {
        if let Some(p) = probes.iter().find(|p| p.gpu_budget_bytes == pages * page) {
            return Ok(p.clone());
        }
        let c = ReplayConfig {
            gpu_budget_bytes: Some(pages * page),
            policy: Policy::Learned,
            ..cfg.clone()
        };
        let r = replay(trace, name, &c, |_| {})?;
        let p = Probe {
            gpu_budget_bytes: pages * page,
            hit_rate: r.run.hit_rate_from(2),
            step_s_median: r.run.median_step_s(2),
            corrupt_pages: r.run.corrupt_pages,
        };
        progress(&p);
        probes.push(p.clone());
        Ok(p)
    };
    let step_limit_s = compute_s * (1.0 + STEP_SLACK);
    let hits_pages = bisect(pages_least, pages_total, |n| {
        Ok(probe(n, &mut probes)?.hit_rate >= HIT_RATE_TARGET)
    })?;
    let step_pages = bisect(pages_least, pages_total, |n| {
        Ok(probe(n, &mut probes)?.step_s_median <= step_limit_s)
    })?;
    Ok(BudgetSearch {
        policy: Policy::Learned.name().into(),
        page_bytes: page,
        pages_bytes: pages_total * page,
        compute_s,
        compute_spread,
        hit_rate_target: HIT_RATE_TARGET,
        step_slack: STEP_SLACK,
        hits_budget_bytes: hits_pages * page,
        step_budget_bytes: step_pages * page,
        probes,
    })
}

/// The resident replay (every page on the GPU): its probe, the compute time (its median
/// step, steps 2..) and the spread of its steps.
fn resident(
    trace: &Trace,
    name: &str,
    cfg: &ReplayConfig,
    budget_bytes: u64,
    probes: &mut Vec<Probe>,
    progress: &mut impl FnMut(&Probe),
) -> Result<(f64, f64)> {
    let c = ReplayConfig {
        gpu_budget_bytes: Some(budget_bytes),
        policy: Policy::Learned,
        ..cfg.clone()
    };
    let r = replay(trace, name, &c, |_| {})?;
    let p = Probe {
        gpu_budget_bytes: budget_bytes,
        hit_rate: r.run.hit_rate_from(2),
        step_s_median: r.run.median_step_s(2),
        corrupt_pages: r.run.corrupt_pages,
    };
    progress(&p);
    probes.push(p.clone());
    let (lo, hi) = r
        .run
        .steps
        .iter()
        .skip(1)
        .fold((f64::INFINITY, 0f64), |(lo, hi), s| {
            (lo.min(s.wall_s), hi.max(s.wall_s))
        });
    let spread = (hi - lo) / p.step_s_median.max(f64::MIN_POSITIVE);
    Ok((p.step_s_median, spread))
}

/// The least `n` in `lo..=hi` for which `ok(n)` holds, given that `ok(hi)` holds and
/// `ok` is monotone (false then true); `hi` when only it holds.
fn bisect(lo: u64, hi: u64, mut ok: impl FnMut(u64) -> Result<bool>) -> Result<u64> {
    let (mut lo, mut hi) = (lo.min(hi), hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ok(mid)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::tests::{forward_trace, sim_config};

    #[test]
    fn bisection_finds_the_least_passing_value_and_asks_few_times() {
        let mut asked = Vec::new();
        let n = bisect(1, 1000, |n| {
            asked.push(n);
            Ok(n >= 337)
        })
        .unwrap();
        assert_eq!(n, 337);
        assert!(asked.len() <= 10, "{asked:?}");
        assert_eq!(bisect(5, 5, |_| Ok(true)).unwrap(), 5);
        assert_eq!(bisect(1, 9, |n| Ok(n == 9)).unwrap(), 9);
    }

    /// 12 one-page buffers, each step forward then backward over them with 2 ms of
    /// compute per access: with next-use eviction and prefetch, a budget of a few pages
    /// already hits, far below the resident 12.
    #[test]
    fn the_search_finds_a_budget_below_the_working_set_that_meets_both_targets() {
        let _serial = crate::workload::tests::serial_timing();
        let there_and_back: Vec<usize> = (0..12).chain((0..12).rev()).collect();
        let t = forward_trace(4, &there_and_back, 65536, 2000);
        let cfg = sim_config();
        let mut heard = 0;
        let r = find_budget(&t, "x", &cfg, |_| heard += 1).unwrap();
        assert_eq!(heard, r.probes.len());
        assert_eq!(r.pages_bytes, 12 << 16);
        assert_eq!(r.probes[0].gpu_budget_bytes, 12 << 16, "resident first");
        assert!(r.probes.iter().all(|p| p.corrupt_pages == 0));
        assert!(r.hits_budget_bytes < r.pages_bytes, "{r:?}");
        assert!(
            r.compute_spread >= 0.0 && r.compute_spread.is_finite(),
            "{r:?}"
        );
        assert!(r.step_budget_bytes <= r.pages_bytes, "{r:?}");
        // Each answer is a budget that was replayed and met its target.
        let at = |b: u64| r.probes.iter().find(|p| p.gpu_budget_bytes == b).unwrap();
        assert!(at(r.hits_budget_bytes).hit_rate >= HIT_RATE_TARGET);
        assert!(at(r.step_budget_bytes).step_s_median <= r.compute_s * (1.0 + STEP_SLACK));
        // One page less than the hits answer was replayed and missed (unless it is the least).
        if r.hits_budget_bytes > 64 << 10 {
            assert!(at(r.hits_budget_bytes - (64 << 10)).hit_rate < HIT_RATE_TARGET);
        }
    }
}
