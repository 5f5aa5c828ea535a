//! SVG plots of the demo, the offload benchmark and replay, written next to their JSON.
//!
//! - [`offload`]: step time per step, every variant, every repeat (one colour a variant);
//! - [`policies`]: replay's step time and stall per step, one line per policy (two panels);
//! - [`time_split`]: the demo's per-step time split into waiting for copies (stall) and
//!   the rest (compute, checks, bookkeeping), stacked.
//!
//! Only plotters' SVG backend is used: no fonts or system libraries beyond it.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::offload::OffloadResult;
use crate::workload::{RunReport, StepReport};

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("plot: {e}")
}

/// The legend of `chart`'s labelled series, the same box on every plot.
fn draw_legend<'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// One line per series of (step, value) points on `area`.
fn lines(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    y_desc: &str,
    series: &[(String, usize, Vec<f64>)],
) -> Result<()> {
    let steps = series
        .iter()
        .map(|(_, _, v)| v.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let ymax = series
        .iter()
        .flat_map(|(_, _, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(1usize..steps, 0f64..ymax.max(1e-6))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    let mut labelled = std::collections::HashSet::new();
    for (name, colour, values) in series {
        let color = Palette99::pick(*colour).to_rgba();
        let drawn = chart
            .draw_series(LineSeries::new(
                values.iter().enumerate().map(|(s, t)| (s + 1, *t)),
                color.stroke_width(2),
            ))
            .map_err(err)?;
        if labelled.insert(name.clone()) {
            drawn.label(name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
    }
    draw_legend(&mut chart)?;
    Ok(())
}

/// The offload benchmark: step time per step of every variant in every repeat.
pub fn offload(r: &OffloadResult, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let series: Vec<_> = r
        .variants
        .iter()
        .enumerate()
        .flat_map(|(i, v)| v.step_s.iter().map(move |s| (v.name.clone(), i, s.clone())))
        .collect();
    lines(
        &root,
        &format!("Step time per step, by variant ({} repeats)", r.repeats),
        "seconds",
        &series,
    )?;
    root.present().map_err(err)?;
    Ok(())
}

/// Replay: step time (top) and stall (bottom) per step, one line per run's policy.
pub fn policies(runs: &[&RunReport], path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (900, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(400);
    // One line per run: its policy, its colour index, `figure` of each step.
    let series = |figure: fn(&StepReport) -> f64| -> Vec<_> {
        runs.iter()
            .enumerate()
            .map(|(i, r)| (r.policy.clone(), i, r.steps.iter().map(figure).collect()))
            .collect()
    };
    let step = series(|s| s.wall_s);
    let stall = series(|s| s.stall_s);
    lines(&top, "Step time per step, by policy", "seconds", &step)?;
    lines(
        &bottom,
        "Stall (waiting for copies) per step, by policy",
        "seconds",
        &stall,
    )?;
    root.present().map_err(err)?;
    Ok(())
}

/// The demo: each step's wall time split into stall (waiting for copies) and the rest.
pub fn time_split(r: &RunReport, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let steps = r.steps.len().max(1);
    let ymax = r.steps.iter().map(|s| s.wall_s).fold(0.0f64, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Time per step: stall and the rest ({})", r.policy),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1usize..steps).into_segmented(), 0f64..ymax.max(1e-6))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("seconds")
        .draw()
        .map_err(err)?;
    let rest_colour = Palette99::pick(0).to_rgba();
    let stall_colour = Palette99::pick(1).to_rgba();
    let bar = |step: usize, from: f64, to: f64, colour: RGBAColor| {
        Rectangle::new(
            [
                (SegmentValue::Exact(step), from),
                (SegmentValue::Exact(step + 1), to),
            ],
            colour.filled(),
        )
    };
    chart
        .draw_series(r.steps.iter().map(|s| {
            let rest = (s.wall_s - s.stall_s).max(0.0);
            bar(s.step, 0.0, rest, rest_colour)
        }))
        .map_err(err)?
        .label("compute and the rest")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], rest_colour.filled()));
    chart
        .draw_series(r.steps.iter().map(|s| {
            let rest = (s.wall_s - s.stall_s).max(0.0);
            bar(s.step, rest, rest + s.stall_s, stall_colour)
        }))
        .map_err(err)?
        .label("stall (waiting for copies)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], stall_colour.filled()));
    draw_legend(&mut chart)?;
    root.present().map_err(err)?;
    Ok(())
}
