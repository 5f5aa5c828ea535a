//! `spillway bench remote`: page throughput between two endpoints on loopback over the
//! peer transport (QUIC with mutual TLS: frames, checksums, in-flight budget) against raw
//! TCP moving the same bytes in the same run ([`spillway_net::bench`]).
//!
//! `--transport` names the transport measured: `quic`, or `ucx`, which also measures the
//! UCX transport in the same run (`ucx_bytes_per_s`); it needs the `ucx` feature
//! (`cargo build --features ucx`, system packages from `scripts/install-ucx.sh`), and is
//! an error naming it without.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use spillway_client::fmt_bytes;
use spillway_net::QuicConfig;
use spillway_net::bench::{ThroughputReport, page_throughput_with};

use crate::size::{PAGE_BYTES_MAX, PAGE_BYTES_MIN, deprecated, size_in};

/// Largest `--bytes`: 1 TiB a round (each round allocates one page per request in flight,
/// not the total).
const TOTAL_BYTES_MAX: u64 = 1 << 40;

/// The transport measured against TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
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

/// What `bench remote --json` prints.
#[derive(Debug, Serialize)]
struct RemoteReport {
    transport: Transport,
    #[serde(flatten)]
    throughput: ThroughputReport,
    quic_over_tcp: f64,
    /// Pages put over the UCX transport (`--transport ucx`).
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_bytes_per_s: Option<f64>,
    /// UCX throughput as a fraction of the TCP baseline.
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_over_tcp: Option<f64>,
    /// The floor under the UCX transport: bare tagged messages of one page each between
    /// two UCX workers (no frames, checksums or copies out of the receive slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_raw_bytes_per_s: Option<f64>,
    /// The UCX settings in effect (`UCX_*` environment variables).
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_env: Option<std::collections::BTreeMap<String, String>>,
    connections_per_peer: u32,
    worker_threads: usize,
    /// The QUIC configuration measured.
    quic: QuicConfig,
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
    let worker_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let throughput = runtime
        .block_on(page_throughput_with(
            &config.clone(),
            args.page_size,
            args.total_bytes,
            args.in_flight,
        ))
        .context("measuring page throughput")?;
    let (ucx_bytes_per_s, ucx_raw_bytes_per_s, ucx_env) = if args.transport == Transport::Ucx {
        let env = std::env::vars()
            .filter(|(k, _)| k.starts_with("UCX_"))
            .collect();
        (
            Some(measure_ucx(
                &runtime,
                &config,
                throughput.page_bytes,
                throughput.total_bytes,
                args.in_flight,
            )?),
            Some(measure_ucx_raw(
                &runtime,
                throughput.page_bytes,
                throughput.total_bytes,
                args.in_flight,
            )?),
            Some(env),
        )
    } else {
        (None, None, None)
    };
    let report = RemoteReport {
        transport: args.transport,
        ucx_over_tcp: ucx_bytes_per_s.map(|u| u / throughput.tcp_bytes_per_s),
        ucx_bytes_per_s,
        ucx_raw_bytes_per_s,
        ucx_env,
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

#[cfg(not(feature = "ucx"))]
fn measure_ucx(
    _runtime: &tokio::runtime::Runtime,
    _config: &QuicConfig,
    _page_bytes: u64,
    _total_bytes: u64,
    _in_flight: usize,
) -> Result<f64> {
    bail!("--transport ucx: this build has no UCX transport (feature `ucx`)")
}

#[cfg(not(feature = "ucx"))]
fn measure_ucx_raw(
    _runtime: &tokio::runtime::Runtime,
    _page_bytes: u64,
    _total_bytes: u64,
    _in_flight: usize,
) -> Result<f64> {
    bail!("--transport ucx: this build has no UCX transport (feature `ucx`)")
}

/// Bare tagged messages of `page_bytes` from one UCX worker to another in this process,
/// `in_flight` sends at once and as many receives posted as the slots allow: bytes per
/// second, best of the rounds. What UCX itself moves, under the transport's frames.
#[cfg(feature = "ucx")]
fn measure_ucx_raw(
    runtime: &tokio::runtime::Runtime,
    page_bytes: u64,
    total_bytes: u64,
    in_flight: usize,
) -> Result<f64> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use spillway_net::ucx::{UcxWorkerConfig, Worker};

    const TAG: u64 = 0x5a;
    let in_flight = in_flight.max(1);
    let slots = (in_flight * 2).clamp(4, 16);
    let config = UcxWorkerConfig {
        recv_slot_bytes: usize::try_from(page_bytes)?,
        recv_slots_count: slots,
        ..UcxWorkerConfig::default()
    };
    let pages = (total_bytes / page_bytes).max(1);
    runtime.block_on(async {
        let sender = Worker::start(&config)?;
        let receiver = Worker::start(&config)?;
        let ep = sender.connect(receiver.address()).await?;
        let data = bytes::Bytes::from(vec![0x5au8; usize::try_from(page_bytes)?]);
        let mut best = 0f64;
        for _ in 0..spillway_net::bench::ROUNDS {
            let (sent, received) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let start = std::time::Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..slots {
                let (receiver, received) = (receiver.clone(), received.clone());
                tasks.spawn(async move {
                    while received.fetch_add(1, Ordering::Relaxed) < pages {
                        let got = receiver.recv(TAG, u64::MAX, None).await?;
                        anyhow::ensure!(got.bytes().len() as u64 == page_bytes, "short message");
                    }
                    Ok(())
                });
            }
            for _ in 0..in_flight {
                let (ep, sent, data) = (ep.clone(), sent.clone(), data.clone());
                tasks.spawn(async move {
                    while sent.fetch_add(1, Ordering::Relaxed) < pages {
                        ep.send_parts(TAG, vec![data.clone()]).await?;
                    }
                    Ok(())
                });
            }
            while let Some(done) = tasks.join_next().await {
                done.context("a UCX bench task")??;
            }
            best = best.max((pages * page_bytes) as f64 / start.elapsed().as_secs_f64());
        }
        drop(ep);
        sender.shutdown().await;
        receiver.shutdown().await;
        Ok(best)
    })
}

/// Pages put over the UCX transport between two loopback endpoints in this process,
/// `in_flight` requests at once: bytes per second, best of the same rounds as the others.
#[cfg(feature = "ucx")]
fn measure_ucx(
    runtime: &tokio::runtime::Runtime,
    config: &QuicConfig,
    page_bytes: u64,
    total_bytes: u64,
    in_flight: usize,
) -> Result<f64> {
    use std::net::{Ipv4Addr, SocketAddr};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use spillway_net::ucx::{UcxTransport, UcxWorkerConfig};
    use spillway_net::{Connection, MemStore, Page, Transport};
    use spillway_types::{BufferId, NodeId, PageId, PoolId};

    /// Distinct page ids the bench cycles through (the store keeps the latest of each).
    const PAGE_IDS: u64 = 64;
    let in_flight = in_flight.max(1);
    let pages = (total_bytes / page_bytes).max(1);
    // The transport receives into buffers of each message's length; the one slot only
    // bounds a message's length.
    let worker = UcxWorkerConfig {
        recv_slot_bytes: usize::try_from(page_bytes)? + (64 << 10),
        recv_slots_count: 1,
        ..UcxWorkerConfig::default()
    };
    runtime.block_on(async {
        let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let pool = PoolId(0xbe_4c);
        let server = UcxTransport::bind(pool, NodeId(1), loopback, config, &worker).await?;
        let serving = server.serve(Arc::new(MemStore::new(PAGE_IDS as usize)))?;
        let client = UcxTransport::bind(pool, NodeId(2), loopback, config, &worker).await?;
        let conn = client.connect(server.local_addr()).await?;
        let data = bytes::Bytes::from(
            (0..page_bytes)
                .map(|i| (i * 31 % 251) as u8)
                .collect::<Vec<u8>>(),
        );
        let mut best = 0f64;
        for _ in 0..spillway_net::bench::ROUNDS {
            let next = Arc::new(AtomicU64::new(0));
            let start = std::time::Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..in_flight {
                let (conn, next, data) = (conn.clone(), next.clone(), data.clone());
                tasks.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= pages {
                            return Ok::<(), spillway_net::NetError>(());
                        }
                        let id = PageId {
                            buffer: BufferId(1),
                            index: (i % PAGE_IDS) as u32,
                        };
                        conn.put_pages(vec![Page::new(id, data.clone())]).await?;
                    }
                });
            }
            while let Some(done) = tasks.join_next().await {
                done.context("a UCX bench task")??;
            }
            let bytes_per_s = (pages * page_bytes) as f64 / start.elapsed().as_secs_f64();
            best = best.max(bytes_per_s);
        }
        drop(conn);
        serving.shutdown().await;
        Ok(best)
    })
}

fn table(r: &RemoteReport) -> String {
    let t = &r.throughput;
    let gb = |b: f64| format!("{:.2} GB/s", b / 1e9);
    let ucx_row = match (r.ucx_bytes_per_s, r.ucx_over_tcp) {
        (Some(u), Some(ratio)) => {
            format!(
                "| UCX (tagged messages, frames, checksums) | {} | **{ratio:.3}** |\n",
                gb(u)
            )
        }
        _ => String::new(),
    };
    let ucx_raw_row = match r.ucx_raw_bytes_per_s {
        Some(u) => format!(
            "| UCX bare tagged messages (no frames, checksums or copies; the floor) | {} | {:.3} |\n",
            gb(u),
            u / t.tcp_bytes_per_s
        ),
        None => String::new(),
    };
    let ucx_env = match &r.ucx_env {
        Some(env) if !env.is_empty() => format!(
            "\nUCX settings: {}\n",
            env.iter()
                .map(|(k, v)| format!("`{k}={v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => String::new(),
    };
    let table = format!(
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
    );
    table + &ucx_row + &ucx_raw_row + &ucx_env
}
