//! Repeats, spread and the machine's load: what every benchmark that compares variants
//! shares (`bench offload`, `bench gpu-offload`, `replay --compare`; issue 18).
//!
//! A comparison runs its whole set of variants `repeats` times, interleaved: repeat 1
//! runs every variant, then repeat 2, ..., and the order rotates each repeat
//! ([`order`]) so none always runs first or last. Each figure is then reported as the
//! median and the min–max of its per-repeat values ([`Spread`]). Neighbours' load moves
//! every figure on a shared machine, so the load average and the core count are recorded
//! before and after ([`Load`]), and the result warns that the machine was busy when the
//! load before the run was at least [`BUSY_LOAD_PER_CORE`] per core ([`is_busy`],
//! [`load_notes`]).

use anyhow::{Result, bail};
use serde::Serialize;

use crate::report::Load;
use crate::workload::median;

/// Default repeats of the whole set of variants.
pub const REPEATS_DEFAULT: usize = 3;
/// Most repeats (each is every variant's run; memory is one variant's pool at a time).
pub const REPEATS_MAX: usize = 100;
/// Load average (1 min) per core before the run at or above which the result warns that
/// the machine was busy: other work then held half the cores or more.
pub const BUSY_LOAD_PER_CORE: f64 = 0.5;

/// `Ok` when `repeats` is 1 to [`REPEATS_MAX`]; otherwise the error names `--repeats`.
pub fn check(repeats: usize) -> Result<()> {
    if repeats == 0 || repeats > REPEATS_MAX {
        bail!("--repeats must be 1 to {REPEATS_MAX}, got {repeats}");
    }
    Ok(())
}

/// The order of the variants in repeat `repeat` (0-based): `first` rotated left by
/// `repeat`.
pub fn order<T: Copy, const N: usize>(first: [T; N], repeat: usize) -> [T; N] {
    let mut o = first;
    if N > 0 {
        o.rotate_left(repeat % N);
    }
    o
}

/// A figure over the repeats: its median and its least and greatest value.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Median of the values.
    pub median: f64,
    /// Least value.
    pub min: f64,
    /// Greatest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all 0 when there are none).
    pub fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread {
                median: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        Spread {
            median: median(values.to_vec()),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// `median (min–max)` with `decimals` decimals.
    pub fn show(&self, decimals: usize) -> String {
        format!(
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

/// Whether the machine was busy: a load (1 min) of at least [`BUSY_LOAD_PER_CORE`] per
/// core.
pub fn is_busy(load: &Load) -> bool {
    load.load_1min >= BUSY_LOAD_PER_CORE * load.cores as f64
}

/// The lines a result prints under its table about the load: the load before and after
/// on the cores, and, when the load before was busy, a warning that starts with
/// `warning:` and says what the load moves (`what_moves`, e.g. "step times").
pub fn load_notes(before: &Load, after: &Load, what_moves: &str) -> Vec<String> {
    let mut notes = vec![format!(
        "load average (1 min) {:.2} before, {:.2} after, on {} cores",
        before.load_1min, after.load_1min, before.cores
    )];
    if is_busy(before) {
        notes.push(format!(
            "warning: the machine was busy (load {:.2} on {} cores before the run): other work shares its cores, so {what_moves} move from run to run; compare the ratios of one run only",
            before.load_1min, before.cores
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(load_1min: f64, cores: usize) -> Load {
        Load {
            load_1min,
            load_5min: 0.0,
            load_15min: 0.0,
            cores,
        }
    }

    #[test]
    fn spread_is_median_min_and_max() {
        let s = Spread::of(&[1.2, 0.9, 1.0]);
        assert_eq!(
            s,
            Spread {
                median: 1.0,
                min: 0.9,
                max: 1.2
            }
        );
        assert_eq!(s.show(3), "1.000 (0.900–1.200)");
        let even = Spread::of(&[4.0, 1.0, 2.0, 3.0]);
        assert_eq!((even.median, even.min, even.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of(&[]).max, 0.0);
        assert_eq!(Spread::of(&[-1.0]).max, -1.0);
    }

    #[test]
    fn order_rotates_each_repeat() {
        let first = ["a", "b", "c"];
        assert_eq!(order(first, 0), ["a", "b", "c"]);
        assert_eq!(order(first, 1), ["b", "c", "a"]);
        assert_eq!(order(first, 3), ["a", "b", "c"]);
        assert!(order::<u8, 0>([], 5).is_empty());
    }

    #[test]
    fn repeats_out_of_range_are_errors() {
        assert!(check(1).is_ok());
        assert!(check(REPEATS_MAX).is_ok());
        for bad in [0, REPEATS_MAX + 1] {
            let e = check(bad).unwrap_err().to_string();
            assert!(e.contains("--repeats must be 1 to 100"), "{e}");
        }
    }

    #[test]
    fn busy_from_half_the_cores_and_warned() {
        assert!(!is_busy(&load(0.99, 2)));
        assert!(is_busy(&load(1.0, 2)));
        assert!(!is_busy(&load(7.9, 16)));
        let quiet = load_notes(&load(0.5, 16), &load(0.7, 16), "ratios");
        assert_eq!(
            quiet,
            ["load average (1 min) 0.50 before, 0.70 after, on 16 cores"]
        );
        let busy = load_notes(&load(3.0, 2), &load(2.5, 2), "ratios");
        assert_eq!(busy.len(), 2);
        assert!(busy[1].starts_with("warning: the machine was busy (load 3.00 on 2 cores"));
        assert!(busy[1].contains("so ratios move"), "{}", busy[1]);
    }
}
