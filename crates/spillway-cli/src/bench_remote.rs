//! `spillway bench remote`: page throughput between two endpoints on loopback over the
//! peer transport (QUIC with mutual TLS: frames, checksums, in-flight budget) against raw
//! TCP moving the same bytes in the same run ([`spillway_net::bench`]).
//!
//! `--transport` names the transport measured: `quic` today; `ucx` is reserved for the
//! UCX transport and is an error until it is built.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use bytesize::ByteSize;
use clap::{Args, ValueEnum};
use serde::Serialize;
use spillway_client::fmt_bytes;
use spillway_net::QuicConfig;
use spillway_net::bench::{ThroughputReport, page_throughput_with};

/// The transport measured against TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// QUIC with mutual TLS (quinn), the peer transport of the nodes.
    Quic,
    /// UCX (not built yet).
    Ucx,
}

/// Arguments of `spillway bench remote`.
#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Page size (a power of two from 64KiB to 64MiB).
    #[arg(long, default_value = "2MiB")]
    page_bytes: ByteSize,
    /// Requests in flight at once on the transport (on the 2-core VM, 2 moved the most:
    /// more than 4, much more than 8 or 16; bench/RESULTS.md).
    #[arg(long, default_value_t = 2)]
    in_flight: usize,
    /// Bytes each method moves per round (three rounds; the best counts).
    #[arg(long = "bytes", value_name = "TOTAL", default_value = "1GiB")]
    total_bytes: ByteSize,
    /// QUIC connections to the peer (the `quic.connections_per_peer` of a node config)
    /// [default: the config's default].
    #[arg(long)]
    connections: Option<u32>,
    /// Override a field of the QUIC config (`[quic]` of a node config), e.g.
    /// `--quic send_window_bytes=8388608`; repeat for several.
    #[arg(long = "quic", value_name = "FIELD=VALUE")]
    quic_overrides: Vec<String>,
    /// Transport to measure against TCP.
    #[arg(long, value_enum, default_value_t = Transport::Quic)]
    transport: Transport,
    /// Print one JSON object: page_bytes, tcp_bytes_per_s, quic_bytes_per_s,
    /// quic_over_tcp and the details.
    #[arg(long)]
    json: bool,
    /// Append the result to this markdown file (e.g. bench/RESULTS.md).
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
}

/// What `bench remote --json` prints.
#[derive(Debug, Serialize)]
struct RemoteReport {
    transport: Transport,
    #[serde(flatten)]
    throughput: ThroughputReport,
    quic_over_tcp: f64,
    connections_per_peer: u32,
    worker_threads: usize,
    /// The QUIC configuration measured.
    quic: QuicConfig,
}

/// Runs `spillway bench remote`.
pub fn run_remote(args: RemoteArgs) -> Result<()> {
    if args.transport == Transport::Ucx {
        bail!(
            "--transport ucx: this build has no UCX transport (the `ucx` feature of \
             spillway-net is not built yet); use --transport quic"
        );
    }
    let mut config: QuicConfig = toml::from_str(&args.quic_overrides.join("\n"))
        .context("--quic: FIELD=VALUE with a field of the [quic] table")?;
    if let Some(c) = args.connections {
        config.connections_per_peer = c;
    }
    config.validate().context("--quic")?;
    let worker_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let throughput = runtime
        .block_on(page_throughput_with(
            &config.clone(),
            args.page_bytes.as_u64(),
            args.total_bytes.as_u64(),
            args.in_flight,
        ))
        .context("measuring page throughput")?;
    let report = RemoteReport {
        transport: args.transport,
        quic_over_tcp: throughput.ratio(),
        throughput,
        connections_per_peer: config.connections_per_peer,
        worker_threads,
        quic: config,
    };
    let json = serde_json::to_string(&report)?;
    if args.json {
        println!("{json}");
    } else {
        print!("{}", table(&report));
    }
    if let Some(path) = &args.record {
        crate::record::append_section(path, "Remote page throughput", &table(&report), &json)?;
    }
    Ok(())
}

fn table(r: &RemoteReport) -> String {
    let t = &r.throughput;
    let gb = |b: f64| format!("{:.2} GB/s", b / 1e9);
    format!(
        "Pages of {} on 127.0.0.1, {} per method per round (best of {} rounds), {} requests in flight, {} QUIC connections, {} runtime threads.\n\n\
         | path | throughput | ratio to TCP |\n|---|---|---|\n\
         | TCP, 1 connection | {} | {:.3} |\n\
         | TCP, 8 connections | {} | {:.3} |\n\
         | QUIC (mutual TLS, frames, checksums) | {} | **{:.3}** |\n",
        fmt_bytes(t.page_bytes),
        fmt_bytes(t.total_bytes),
        spillway_net::bench::ROUNDS,
        t.in_flight,
        r.connections_per_peer,
        r.worker_threads,
        gb(t.tcp_1_bytes_per_s),
        t.tcp_1_bytes_per_s / t.tcp_bytes_per_s,
        gb(t.tcp_8_bytes_per_s),
        t.tcp_8_bytes_per_s / t.tcp_bytes_per_s,
        gb(t.quic_bytes_per_s),
        r.quic_over_tcp,
    )
}
