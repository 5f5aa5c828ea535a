//! The GPU offload benchmark's figures (`bench gpu-offload`, [`crate::gpu_offload`] with
//! the `cuda` feature): their types, the fold of the repeats into medians and min–max,
//! and the Markdown. Nothing here touches a GPU, so it builds and is tested everywhere.
//!
//! Each repeat yields one [`GpuBatch`] per batch size, every variant's figures measured
//! in that repeat, its ratio to its own floor taken against that repeat's compute time
//! and copy bandwidth. [`fold_repeats`] turns the repeats into one set: step time and
//! ratio as median and min–max over the repeats (and each repeat's ratio), every other
//! figure the median over the repeats. The repeats, the rotation of the variants and the
//! load warning are [`crate::repeats`]'s, as for `bench offload`.

use serde::Serialize;

use crate::repeats::{Spread, load_notes};
use crate::report::Load;
use crate::workload::median;

/// One variant at one batch size. Times are seconds per step. In one repeat: medians over
/// the timed steps for `step_s` and `stall_s`, means for the rest; over the repeats
/// ([`fold_repeats`]): the median of those, with the step time's and the ratio's spread.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuVariant {
    /// Variant name.
    pub name: String,
    /// Median step time.
    pub step_s: f64,
    /// Least of the repeats' step times.
    pub step_s_min: f64,
    /// Greatest of the repeats' step times.
    pub step_s_max: f64,
    /// Bytes copied host to device per step.
    pub h2d_bytes_per_step: f64,
    /// Bytes copied device to host per step.
    pub d2h_bytes_per_step: f64,
    /// The variant's own floor: max(compute, its own bytes at `copy_only`'s bandwidth).
    pub own_floor_s: f64,
    /// Median over the repeats of `step_s / own_floor_s` (each repeat's own).
    pub ratio_to_own_floor: f64,
    /// Least of the repeats' ratios.
    pub ratio_min: f64,
    /// Greatest of the repeats' ratios.
    pub ratio_max: f64,
    /// Each repeat's ratio, in the order the repeats ran.
    pub ratios: Vec<f64>,
    /// Hits / acquires over the timed steps (1 for `copy_only`).
    pub hit_rate: f64,
    /// Median time acquires waited for copies.
    pub stall_s: f64,
    /// The pool's planning on the caller's thread (acquires and `step`).
    pub planning_s: f64,
    /// Waiting for the pool's lock on the caller's thread.
    pub lock_wait_s: f64,
    /// Showing acquired layers as one array on the caller's thread (mapping included).
    pub view_s: f64,
    /// Launching the GEMMs and dropping the guards.
    pub launch_s: f64,
    /// Waiting at the end of the step for the compute stream (GEMMs still queued).
    pub sync_s: f64,
    /// Time inside `acquire` (stall, planning, lock waits and view, and the rest of the
    /// call).
    pub acquire_s: f64,
    /// Step time outside acquires, launches and the sync (the loop itself; ~0).
    pub unaccounted_s: f64,
    /// The device's threads: handling completions and fenced releases (planning).
    pub device_planning_s: f64,
    /// The device's threads: waiting for the pool's lock.
    pub device_lock_wait_s: f64,
    /// The completion threads' time inside the pool's handler (a completion behind
    /// another reaches the pool that much later).
    pub completion_s: f64,
    /// The copy lanes' submitter threads: enqueueing copies off the caller's thread.
    pub submit_thread_s: f64,
    /// Driver copies per step (neighbouring pages submitted together share one).
    pub copies_per_step: f64,
    /// Completions whose copy had already finished when their thread came to them.
    pub completions_late_per_step: f64,
    /// Layers shown at their frames' own addresses (consecutive frames, no mapping).
    pub views_in_place_per_step: f64,
    /// Layers shown through their buffer range (pages mapped first).
    pub views_mapped_per_step: f64,
    /// Pages mapped into a buffer range where another frame was.
    pub remaps_per_step: f64,
    /// Seconds of driver calls for those mappings (inside `view_s`).
    pub remap_s_per_step: f64,
}

/// All variants at one batch size.
#[derive(Debug, Clone, Serialize)]
pub struct GpuBatch {
    /// Batch size.
    pub batch: usize,
    /// The GEMMs alone (`resident`'s median step): every variant's compute floor.
    pub compute_s: f64,
    /// Host-to-device bandwidth of `copy_only` (same page size), bytes/s.
    pub copy_bytes_per_s: f64,
    /// GEMM throughput with every layer resident, TFLOP/s.
    pub tflops_resident: f64,
    /// The variants.
    pub variants: Vec<GpuVariant>,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct GpuOffloadResult {
    /// The GPU.
    pub device: String,
    /// The host.
    pub machine: String,
    /// Layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Layers the budget holds.
    pub slots: usize,
    /// Page size.
    pub page_bytes: u64,
    /// The pool's default page size on this device (what a pool built without one uses).
    pub default_page_bytes: u64,
    /// Repeats of the whole set of variants, interleaved.
    pub repeats: usize,
    /// Pages checked against their checksum in `learned`'s first step.
    pub verified_pages: u64,
    /// Pages whose checksum was wrong (must be 0).
    pub corrupt_pages: u64,
    /// Per batch size, folded over the repeats.
    pub batches: Vec<GpuBatch>,
    /// The load before the first run.
    pub load_before: Load,
    /// The load after the last run.
    pub load_after: Load,
    /// Whether the load before the run was at least
    /// [`crate::repeats::BUSY_LOAD_PER_CORE`] per core.
    pub busy: bool,
}

/// One variant over its repeats: step time and ratio as median and min–max, each repeat's
/// ratio, every other figure the median.
fn fold_variant(reps: &[&GpuVariant]) -> GpuVariant {
    let m = |f: fn(&GpuVariant) -> f64| median(reps.iter().map(|v| f(v)).collect());
    let steps: Vec<f64> = reps.iter().map(|v| v.step_s).collect();
    let ratios: Vec<f64> = reps.iter().map(|v| v.ratio_to_own_floor).collect();
    let (step, ratio) = (Spread::of(&steps), Spread::of(&ratios));
    GpuVariant {
        name: reps.first().map(|v| v.name.clone()).unwrap_or_default(),
        step_s: step.median,
        step_s_min: step.min,
        step_s_max: step.max,
        ratio_to_own_floor: ratio.median,
        ratio_min: ratio.min,
        ratio_max: ratio.max,
        ratios,
        h2d_bytes_per_step: m(|v| v.h2d_bytes_per_step),
        d2h_bytes_per_step: m(|v| v.d2h_bytes_per_step),
        own_floor_s: m(|v| v.own_floor_s),
        hit_rate: m(|v| v.hit_rate),
        stall_s: m(|v| v.stall_s),
        planning_s: m(|v| v.planning_s),
        lock_wait_s: m(|v| v.lock_wait_s),
        view_s: m(|v| v.view_s),
        launch_s: m(|v| v.launch_s),
        sync_s: m(|v| v.sync_s),
        acquire_s: m(|v| v.acquire_s),
        unaccounted_s: m(|v| v.unaccounted_s),
        device_planning_s: m(|v| v.device_planning_s),
        device_lock_wait_s: m(|v| v.device_lock_wait_s),
        completion_s: m(|v| v.completion_s),
        submit_thread_s: m(|v| v.submit_thread_s),
        copies_per_step: m(|v| v.copies_per_step),
        completions_late_per_step: m(|v| v.completions_late_per_step),
        views_in_place_per_step: m(|v| v.views_in_place_per_step),
        views_mapped_per_step: m(|v| v.views_mapped_per_step),
        remaps_per_step: m(|v| v.remaps_per_step),
        remap_s_per_step: m(|v| v.remap_s_per_step),
    }
}

/// Folds the repeats (one list of batches per repeat, in the order they ran) into one
/// list: per batch size the median compute time, bandwidth and throughput, and each
/// variant by name through [`fold_variant`]. Batches and variants keep the first
/// repeat's order; a variant missing from a repeat is folded over the repeats it ran in.
pub fn fold_repeats(repeats: &[Vec<GpuBatch>]) -> Vec<GpuBatch> {
    let Some(first) = repeats.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(bi, b)| {
            let same: Vec<&GpuBatch> = repeats.iter().filter_map(|r| r.get(bi)).collect();
            let m = |f: fn(&GpuBatch) -> f64| median(same.iter().map(|b| f(b)).collect());
            GpuBatch {
                batch: b.batch,
                compute_s: m(|b| b.compute_s),
                copy_bytes_per_s: m(|b| b.copy_bytes_per_s),
                tflops_resident: m(|b| b.tflops_resident),
                variants: b
                    .variants
                    .iter()
                    .map(|v| {
                        let reps: Vec<&GpuVariant> = same
                            .iter()
                            .filter_map(|b| b.variants.iter().find(|x| x.name == v.name))
                            .collect();
                        fold_variant(&reps)
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The lines under the tables: the repeats and the load, and a warning when the machine
/// was busy.
pub fn notes(r: &GpuOffloadResult) -> Vec<String> {
    let mut notes = vec![format!(
        "{} repeats, interleaved (the variants' order rotates each repeat); step and ratio: median (min–max) over the repeats, other figures their median; each repeat's ratio is to that repeat's own floor",
        r.repeats
    )];
    notes.extend(load_notes(&r.load_before, &r.load_after, "step times"));
    notes
}

/// The result as Markdown: the step against its own floor, then where the time went.
pub fn markdown(r: &GpuOffloadResult) -> String {
    let mut s = format!(
        "{} layers of {}x{} bf16 ({} MiB each), GPU budget {} layers, page {} MiB (the pool's \
         default page size: {} MiB), {} ({}); pages verified {}, corrupt {}\n\n",
        r.layers,
        r.hidden,
        r.hidden,
        (r.hidden * r.hidden * 2) >> 20,
        r.slots,
        r.page_bytes >> 20,
        r.default_page_bytes >> 20,
        r.device,
        r.machine,
        r.verified_pages,
        r.corrupt_pages
    );
    s += "Own floor = max(compute, the variant's own host-to-device bytes at copy_only's \
          bandwidth). Times in seconds per step.\n\n\
          | batch | variant | step s (median) | step min–max | GiB moved/step | own floor s | ratio to own floor (min–max) | hit rate | stall | planning | lock wait | view (mapping) | remaps/step | launch | end sync | device threads: completions | device threads: lock wait |\n\
          |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for b in &r.batches {
        for v in &b.variants {
            let ratio = Spread {
                median: v.ratio_to_own_floor,
                min: v.ratio_min,
                max: v.ratio_max,
            };
            s += &format!(
                "| {} | {} | {:.4} | {:.4}–{:.4} | {:.2} | {:.4} | {} | {:.3} | {:.4} | {:.4} | {:.4} | {:.4} | {:.0} | {:.4} | {:.4} | {:.4} | {:.4} |\n",
                b.batch,
                v.name,
                v.step_s,
                v.step_s_min,
                v.step_s_max,
                (v.h2d_bytes_per_step + v.d2h_bytes_per_step) / (1u64 << 30) as f64,
                v.own_floor_s,
                ratio.show(3),
                v.hit_rate,
                v.stall_s,
                v.planning_s,
                v.lock_wait_s,
                v.view_s,
                v.remaps_per_step,
                v.launch_s,
                v.sync_s,
                v.device_planning_s,
                v.device_lock_wait_s,
            );
        }
    }
    s += "\n";
    for n in notes(r) {
        s += &n;
        s += "\n\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn variant(name: &str, step_s: f64, ratio: f64, planning_s: f64) -> GpuVariant {
        GpuVariant {
            name: name.into(),
            step_s,
            ratio_to_own_floor: ratio,
            planning_s,
            hit_rate: 1.0,
            ..GpuVariant::default()
        }
    }

    fn batch(batch: usize, compute_s: f64, variants: Vec<GpuVariant>) -> GpuBatch {
        GpuBatch {
            batch,
            compute_s,
            copy_bytes_per_s: 50e9,
            tflops_resident: 500.0,
            variants,
        }
    }

    #[test]
    fn repeats_fold_into_median_and_min_max_by_name() {
        // Three repeats (compute time, then per variant: name, step, ratio, planning);
        // the variants ran in a rotated order in the second.
        let repeats: Vec<Vec<GpuBatch>> = [
            (
                0.10,
                [
                    ("resident", 0.10, 1.0, 0.001),
                    ("learned", 0.11, 1.05, 0.004),
                ],
            ),
            (
                0.12,
                [
                    ("learned", 0.10, 0.98, 0.002),
                    ("resident", 0.12, 1.0, 0.001),
                ],
            ),
            (
                0.11,
                [
                    ("resident", 0.11, 1.0, 0.003),
                    ("learned", 0.13, 1.20, 0.003),
                ],
            ),
        ]
        .into_iter()
        .map(|(compute_s, vs)| {
            let vs = vs.into_iter().map(|(n, s, r, p)| variant(n, s, r, p));
            vec![batch(1024, compute_s, vs.collect())]
        })
        .collect();
        let folded = fold_repeats(&repeats);
        assert_eq!(folded.len(), 1);
        let b = &folded[0];
        assert_eq!(b.batch, 1024);
        assert!((b.compute_s - 0.11).abs() < 1e-12);
        let names: Vec<&str> = b.variants.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["resident", "learned"]);
        let l = &b.variants[1];
        assert_eq!((l.step_s, l.step_s_min, l.step_s_max), (0.11, 0.10, 0.13));
        assert_eq!(
            (l.ratio_to_own_floor, l.ratio_min, l.ratio_max),
            (1.05, 0.98, 1.20)
        );
        assert_eq!(l.ratios, [1.05, 0.98, 1.20]);
        assert_eq!(l.planning_s, 0.003);
        assert_eq!(l.hit_rate, 1.0);
        let r = &b.variants[0];
        assert_eq!((r.ratio_min, r.ratio_max), (1.0, 1.0));
        assert!(fold_repeats(&[]).is_empty());
    }

    #[test]
    fn a_variant_missing_from_a_repeat_is_folded_over_the_others() {
        let repeats = vec![
            vec![batch(1, 0.1, vec![variant("learned", 0.2, 2.0, 0.0)])],
            vec![batch(1, 0.1, vec![])],
        ];
        let v = &fold_repeats(&repeats)[0].variants[0];
        assert_eq!((v.step_s, v.ratios.len()), (0.2, 1));
    }

    #[test]
    fn markdown_shows_the_spread_the_load_and_warns_when_busy() {
        let load = |l| Load {
            load_1min: l,
            load_5min: 0.0,
            load_15min: 0.0,
            cores: 16,
        };
        let mut v = variant("learned", 0.1, 0.99, 0.002);
        (v.ratio_min, v.ratio_max, v.step_s_min, v.step_s_max) = (0.97, 1.01, 0.098, 0.102);
        let mut r = GpuOffloadResult {
            device: "NVIDIA H200".into(),
            machine: "host".into(),
            layers: 48,
            hidden: 8192,
            slots: 8,
            page_bytes: 2 << 20,
            default_page_bytes: 2 << 20,
            repeats: 3,
            verified_pages: 3072,
            corrupt_pages: 0,
            batches: vec![batch(1024, 0.1, vec![v])],
            load_before: load(1.0),
            load_after: load(1.5),
            busy: false,
        };
        let md = markdown(&r);
        assert!(
            md.contains("| 1024 | learned | 0.1000 | 0.0980–0.1020 |"),
            "{md}"
        );
        assert!(md.contains("| 0.990 (0.970–1.010) |"), "{md}");
        assert!(md.contains("3 repeats, interleaved"), "{md}");
        assert!(md.contains("load average (1 min) 1.00 before, 1.50 after, on 16 cores"));
        assert!(!md.contains("warning"), "{md}");
        r.load_before = load(9.0);
        assert!(markdown(&r).contains("warning: the machine was busy (load 9.00 on 16 cores"));
    }
}
