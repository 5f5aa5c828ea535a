//! The offload benchmark: the demo's workload under every policy, against its floor.
//!
//! Variants, each run in the same process one after the other:
//! - `resident`: the GPU budget holds the whole working set; after the first step no page
//!   moves. This is the compute-only time.
//! - `copy_only`: no compute; the device's two copy streams move, per step, the bytes
//!   that `learned` moved per step (its median), both directions at once, every copy
//!   queued up front. This is the copy-only time.
//! - `on_demand`: pages come in when acquired and leave when released.
//! - `clock`: pages come in when acquired and stay cached; CLOCK evicts.
//! - `learned`: learned prefetch with next-use eviction.
//!
//! The floor is max(resident, copy_only): no schedule can beat either. Each variant's
//! step time is the median over steps 2.. (step 1 has nothing to learn from and fills
//! the GPU); its ratio to the floor is what to compare, since the machines are noisy
//! and only ratios measured in one run mean anything.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde::Serialize;
use spillway_client::{
    Completion, CompletionSink, CopyOp, Direction, FrameId, HostSlot, Policy, TransferId,
    fmt_bytes, make_device,
};

use crate::report::{machine_description, now_rfc3339};
use crate::workload::{RunReport, TrainConfig, median, run_training};

/// What to run.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// The workload; its budget is the one the cached variants get.
    pub train: TrainConfig,
    /// Where the plot and JSON go.
    pub out_dir: PathBuf,
    /// No progress output.
    pub quiet: bool,
}

/// One variant's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Variant {
    /// `resident`, `copy_only`, `on_demand`, `clock` or `learned`.
    pub name: String,
    /// Median step time over steps 2.., seconds.
    pub step_s_median: f64,
    /// `step_s_median / floor_s`.
    pub ratio_to_floor: f64,
    /// Hits / acquires over steps 2.. (1 for copy_only, which acquires nothing).
    pub hit_rate: f64,
    /// Median stall time per step over steps 2.., seconds.
    pub stall_s_median: f64,
    /// Median host-to-device bytes per step over steps 2...
    pub h2d_bytes_per_step: u64,
    /// Median device-to-host bytes per step over steps 2...
    pub d2h_bytes_per_step: u64,
    /// Corrupt pages seen (must be 0).
    pub corrupt_pages: u64,
    /// Every step's time, for the plot.
    pub step_s: Vec<f64>,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadResult {
    /// max(resident, copy_only), seconds per step.
    pub floor_s: f64,
    /// Every variant, in the order above.
    pub variants: Vec<Variant>,
    /// The device.
    pub device: String,
    /// Page size.
    pub page_bytes: u64,
    /// GPU budget of the cached variants.
    pub gpu_budget_bytes: u64,
    /// Bytes of all buffers.
    pub working_set_bytes: u64,
    /// Steps per variant.
    pub steps: usize,
    /// The machine.
    pub machine: String,
}

impl OffloadResult {
    /// The variant called `name`.
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| v.name == name)
    }
}

fn from_run(name: &str, r: &RunReport) -> Variant {
    let later: Vec<_> = r.steps.iter().filter(|s| s.step >= 2).collect();
    Variant {
        name: name.into(),
        step_s_median: r.median_step_s(2),
        ratio_to_floor: 0.0,
        hit_rate: r.hit_rate_from(2),
        stall_s_median: median(later.iter().map(|s| s.stall_s).collect()),
        h2d_bytes_per_step: median(later.iter().map(|s| s.h2d_bytes as f64).collect()) as u64,
        d2h_bytes_per_step: median(later.iter().map(|s| s.d2h_bytes as f64).collect()) as u64,
        corrupt_pages: r.corrupt_pages,
        step_s: r.steps.iter().map(|s| s.wall_s).collect(),
    }
}

/// Moves `h2d` and `d2h` bytes per step through a fresh device's copy streams, `steps`
/// times, and returns each step's time.
fn copy_only(cfg: &TrainConfig, h2d: u64, d2h: u64) -> Result<Vec<f64>> {
    let page = cfg.page_size.bytes();
    let frames = (cfg.gpu_budget_bytes / page).max(2) as u32;
    let (tx, rx) = mpsc::channel::<Completion>();
    let tx = Mutex::new(tx);
    let sink: CompletionSink = Arc::new(move |c| {
        let _ = tx.lock().expect("sender").send(c);
    });
    let device_config = spillway_client::DeviceConfig {
        frames,
        host_slots: frames,
        page_bytes: page,
    };
    let device = make_device(cfg.device, device_config, sink)?;
    let half = frames / 2;
    let mut times = Vec::new();
    let mut next_id = 0u64;
    for _ in 0..cfg.steps {
        let started = Instant::now();
        let (mut n_h2d, mut n_d2h) = (h2d.div_ceil(page), d2h.div_ceil(page));
        let total = n_h2d + n_d2h;
        let mut k = 0u32;
        // Interleave the directions so both streams start at once; the halves of the
        // frames and slots keep the two directions' memory apart.
        while n_h2d + n_d2h > 0 {
            for (dir, n, base) in [
                (Direction::HostToDevice, &mut n_h2d, 0),
                (Direction::DeviceToHost, &mut n_d2h, half),
            ] {
                if *n > 0 {
                    *n -= 1;
                    next_id += 1;
                    let i = base + k % half.max(1);
                    device.submit(CopyOp {
                        id: TransferId(next_id),
                        direction: dir,
                        frame: FrameId(i),
                        slot: HostSlot(i),
                        bytes: page,
                    });
                }
            }
            k += 1;
        }
        for _ in 0..total {
            rx.recv().context("device stopped")?.result?;
        }
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// Runs every variant and writes `offload.json` and `offload.svg` to the out folder.
pub fn run(cfg: &OffloadConfig) -> Result<OffloadResult> {
    let train = &cfg.train;
    let say = |msg: &str| {
        if !cfg.quiet {
            eprintln!("{msg}");
        }
    };
    let page = train.page_size.bytes();
    let mut resident_cfg = train.clone();
    resident_cfg.gpu_budget_bytes =
        train.working_set_bytes().div_ceil(page) * page + train.layers as u64 * 2 * page;
    say("running resident (everything fits on the GPU)...");
    let resident = run_training(resident_cfg, |_| {})?;
    let mut runs = Vec::new();
    for policy in [Policy::Learned, Policy::OnDemand, Policy::Clock] {
        say(&format!("running {}...", policy.name()));
        let mut c = train.clone();
        c.policy = policy;
        runs.push((policy.name(), run_training(c, |_| {})?));
    }
    let learned = from_run("learned", &runs[0].1);
    say("running copy_only (learned's bytes per step, no compute)...");
    let copy_times = copy_only(
        train,
        learned.h2d_bytes_per_step,
        learned.d2h_bytes_per_step,
    )?;
    let copy_variant = Variant {
        name: "copy_only".into(),
        step_s_median: median(copy_times.iter().skip(1).copied().collect()),
        ratio_to_floor: 0.0,
        hit_rate: 1.0,
        stall_s_median: 0.0,
        h2d_bytes_per_step: learned.h2d_bytes_per_step,
        d2h_bytes_per_step: learned.d2h_bytes_per_step,
        corrupt_pages: 0,
        step_s: copy_times,
    };
    let mut variants = vec![
        from_run("resident", &resident),
        copy_variant,
        from_run("on_demand", &runs[1].1),
        from_run("clock", &runs[2].1),
        learned,
    ];
    let floor_s = variants[0].step_s_median.max(variants[1].step_s_median);
    for v in &mut variants {
        v.ratio_to_floor = v.step_s_median / floor_s;
    }
    let result = OffloadResult {
        floor_s,
        variants,
        device: resident.device_description.clone(),
        page_bytes: page,
        gpu_budget_bytes: train.gpu_budget_bytes,
        working_set_bytes: train.working_set_bytes(),
        steps: train.steps,
        machine: machine_description(),
    };
    std::fs::create_dir_all(&cfg.out_dir)
        .with_context(|| format!("creating {}", cfg.out_dir.display()))?;
    std::fs::write(
        cfg.out_dir.join("offload.json"),
        serde_json::to_string_pretty(&result)?,
    )?;
    plot(&result, &cfg.out_dir.join("offload.svg"))?;
    say(&format!(
        "wrote {} and offload.svg",
        cfg.out_dir.join("offload.json").display()
    ));
    Ok(result)
}

/// Prints the result as a table.
pub fn print_table(r: &OffloadResult) {
    println!(
        "offload benchmark: working set {} on a GPU budget of {} ({:.1}x), page {}, {} steps, {}",
        fmt_bytes(r.working_set_bytes),
        fmt_bytes(r.gpu_budget_bytes),
        r.working_set_bytes as f64 / r.gpu_budget_bytes as f64,
        fmt_bytes(r.page_bytes),
        r.steps,
        r.device
    );
    print!("{}", markdown_table(r));
}

fn markdown_table(r: &OffloadResult) -> String {
    let mut s = String::from(
        "| variant | step s (median) | ratio to floor | hit rate | stall s/step | to GPU/step | from GPU/step |\n|---|---|---|---|---|---|---|\n",
    );
    for v in &r.variants {
        s += &format!(
            "| {} | {:.4} | {:.3} | {:.4} | {:.4} | {} | {} |\n",
            v.name,
            v.step_s_median,
            v.ratio_to_floor,
            v.hit_rate,
            v.stall_s_median,
            fmt_bytes(v.h2d_bytes_per_step),
            fmt_bytes(v.d2h_bytes_per_step)
        );
    }
    s += &format!(
        "\nfloor (max of resident and copy_only): {:.4} s/step\n",
        r.floor_s
    );
    s
}

/// Appends the result, the command that produced it and the machine to a Markdown file.
pub fn record_markdown(r: &OffloadResult, path: &Path, command: &str) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(
        f,
        "\n### Offload benchmark, {}\n\nCommand: `{}`\n\nMachine: {}; device: {}\n\nWorking set {} on a GPU budget of {} ({:.1}x), page {}, {} steps.\n\n{}",
        now_rfc3339(),
        command,
        r.machine,
        r.device,
        fmt_bytes(r.working_set_bytes),
        fmt_bytes(r.gpu_budget_bytes),
        r.working_set_bytes as f64 / r.gpu_budget_bytes as f64,
        fmt_bytes(r.page_bytes),
        r.steps,
        markdown_table(r)
    )?;
    Ok(())
}

fn plot(r: &OffloadResult, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let steps = r.steps.max(1);
    let ymax = r
        .variants
        .iter()
        .flat_map(|v| v.step_s.iter().copied())
        .fold(0.0f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("Step time per step, by variant", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(1usize..steps, 0f64..ymax.max(1e-6))
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("seconds")
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    for (i, v) in r.variants.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                v.step_s.iter().enumerate().map(|(s, t)| (s + 1, *t)),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?
            .label(v.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    Ok(())
}
