//! `spillway bench remote`: the flags, then [`spillway_bench::remote`], which measures page
//! throughput between two endpoints on loopback over the peer transport (QUIC with mutual
//! TLS: frames, checksums, in-flight budget) against raw TCP moving the same bytes in the
//! same run.
//!
//! `--transport` names the transport measured: `quic`, or `ucx`, which also measures the
//! UCX transport in the same run (`ucx_bytes_per_s`); it needs the `ucx` feature
//! (`cargo build --features ucx`, system packages from `scripts/install-ucx.sh`), and is
//! an error naming it without.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use spillway_bench::remote::{self, RemoteConfig, RemoteTransport};
use spillway_net::QuicConfig;

use crate::size::{PAGE_BYTES_MAX, PAGE_BYTES_MIN, deprecated, size_in};

/// Largest `--bytes`: 1 TiB a round (each round allocates one page per request in flight,
/// not the total).
const TOTAL_BYTES_MAX: u64 = 1 << 40;

/// The transport measured against TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// QUIC with mutual TLS (quinn), the peer transport of the nodes.
    Quic,
    /// UCX tagged messages (feature `ucx`), measured beside QUIC and TCP.
    Ucx,
}

/// Arguments of `spillway bench remote`.
#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Page size, a power of two from 64KiB to 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "2MiB",
          value_parser = size_in(PAGE_BYTES_MIN..=PAGE_BYTES_MAX))]
    page_size: u64,
    /// Deprecated: --page-size.
    #[arg(long, hide = true, value_name = "SIZE", conflicts_with = "page_size",
          value_parser = size_in(PAGE_BYTES_MIN..=PAGE_BYTES_MAX))]
    page_bytes: Option<u64>,
    /// Requests in flight at once on the transport (on the 2-core VM, 2 moved the most:
    /// more than 4, much more than 8 or 16; bench/RESULTS.md).
    #[arg(long, default_value_t = 2)]
    in_flight: usize,
    /// Bytes each method moves per round (three rounds; the best counts), at most 1TiB.
    #[arg(long = "bytes", value_name = "SIZE", default_value = "1GiB",
          value_parser = size_in(1..=TOTAL_BYTES_MAX))]
    total_bytes: u64,
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

/// Runs `spillway bench remote`.
pub fn run_remote(mut args: RemoteArgs) -> Result<()> {
    if let Some(p) = args.page_bytes.take() {
        deprecated("--page-bytes", "--page-size", p);
        args.page_size = p;
    }
    if args.transport == Transport::Ucx && !cfg!(feature = "ucx") {
        bail!(
            "--transport ucx: this build has no UCX transport; build spillway with \
             `--features ucx` (system packages: scripts/install-ucx.sh), or use --transport quic"
        );
    }
    let mut config: QuicConfig = toml::from_str(&args.quic_overrides.join("\n"))
        .context("--quic: FIELD=VALUE with a field of the [quic] table")?;
    if let Some(c) = args.connections {
        config.connections_per_peer = c;
    }
    config.validate().context("--quic")?;
    // Progress on stderr (the rounds take seconds each; stdout keeps the result).
    eprintln!(
        "bench remote: TCP (1 and 8 connections), QUIC{}, {} rounds of {} each...",
        if args.transport == Transport::Ucx {
            " and UCX"
        } else {
            ""
        },
        remote::ROUNDS,
        spillway_client::fmt_bytes(args.total_bytes)
    );
    let report = remote::run(&RemoteConfig {
        transport: match args.transport {
            Transport::Quic => RemoteTransport::Quic,
            Transport::Ucx => RemoteTransport::Ucx,
        },
        quic: config,
        page_bytes: args.page_size,
        total_bytes: args.total_bytes,
        in_flight: args.in_flight,
    })?;
    let json = serde_json::to_string(&report)?;
    if args.json {
        println!("{json}");
    } else {
        print!("{}", remote::terminal(&report));
    }
    if let Some(path) = &args.record {
        crate::record::append_section(
            path,
            "Remote page throughput",
            &remote::markdown(&report),
            &json,
        )?;
    }
    Ok(())
}
