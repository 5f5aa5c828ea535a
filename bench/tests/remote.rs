//! The throughput function runs end to end with a small total and measures both paths.

use spillway_bench::remote::page_throughput;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_throughput_measures_tcp_and_quic() {
    let report = page_throughput(2 << 20, 64 << 20, 4).await.unwrap();
    assert_eq!(report.page_bytes, 2 << 20);
    assert_eq!(report.total_bytes, 64 << 20);
    assert!(report.tcp_bytes_per_s > 0.0, "{report:?}");
    assert!(report.quic_bytes_per_s > 0.0, "{report:?}");
    println!(
        "tcp {:.2} GB/s (1 conn {:.2}, 8 conns {:.2}), quic {:.2} GB/s, ratio {:.2} (debug build: see examples/page_throughput.rs for the release figure)",
        report.tcp_bytes_per_s / 1e9,
        report.tcp_1_bytes_per_s / 1e9,
        report.tcp_8_bytes_per_s / 1e9,
        report.quic_bytes_per_s / 1e9,
        report.ratio()
    );
}
