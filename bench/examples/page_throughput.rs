//! Page throughput over QUIC against raw TCP on loopback, in one run:
//!
//! ```text
//! cargo run --release -p spillway-bench --example page_throughput -- [total_mib] [in_flight] [page_kib] [lanes]
//! ```
//!
//! Defaults: 1024 MiB, 4 requests in flight, 2048 KiB pages, and the default
//! `QuicConfig` (whose `connections_per_peer` the fourth argument overrides). Prints one JSON line with
//! `page_bytes`, `tcp_bytes_per_s`, `quic_bytes_per_s` (and the details), then the ratio.

use spillway_bench::remote::page_throughput_with;
use spillway_net::QuicConfig;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let total_mib = args.first().copied().unwrap_or(1024);
    let in_flight = args.get(1).copied().unwrap_or(4) as usize;
    let page_kib = args.get(2).copied().unwrap_or(2048);
    let mut config = QuicConfig::default();
    if let Some(lanes) = args.get(3) {
        config.connections_per_peer = u32::try_from(*lanes)?;
    }
    let report = page_throughput_with(&config, page_kib << 10, total_mib << 20, in_flight).await?;
    println!("{}", serde_json::to_string(&report)?);
    eprintln!(
        "QUIC {:.2} GB/s vs TCP {:.2} GB/s (1 conn {:.2}, 8 conns {:.2}): ratio {:.2}",
        report.quic_bytes_per_s / 1e9,
        report.tcp_bytes_per_s / 1e9,
        report.tcp_1_bytes_per_s / 1e9,
        report.tcp_8_bytes_per_s / 1e9,
        report.ratio()
    );
    Ok(())
}
