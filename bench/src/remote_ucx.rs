//! The UCX measurements of `spillway bench remote --transport ucx`: pages put over the UCX
//! transport, and bare tagged messages between two UCX workers (the floor under it). Both
//! need the `ucx` feature; without it they are an error naming it.

#[cfg(feature = "ucx")]
use anyhow::Context;
use anyhow::Result;
#[cfg(not(feature = "ucx"))]
use anyhow::bail;
use spillway_net::QuicConfig;

#[cfg(not(feature = "ucx"))]
pub(crate) fn measure_ucx(
    _runtime: &tokio::runtime::Runtime,
    _config: &QuicConfig,
    _page_bytes: u64,
    _total_bytes: u64,
    _in_flight: usize,
) -> Result<f64> {
    bail!("--transport ucx: this build has no UCX transport (feature `ucx`)")
}

#[cfg(not(feature = "ucx"))]
pub(crate) fn measure_ucx_raw(
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
pub(crate) fn measure_ucx_raw(
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
        let best = best_round(pages * page_bytes, |tasks| {
            let (sent, received) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
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
        })
        .await?;
        drop(ep);
        sender.shutdown().await;
        receiver.shutdown().await;
        Ok(best)
    })
}

/// Pages put over the UCX transport between two loopback endpoints in this process,
/// `in_flight` requests at once: bytes per second, best of the same rounds as the others.
#[cfg(feature = "ucx")]
pub(crate) fn measure_ucx(
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
        let best = best_round(pages * page_bytes, |tasks| {
            let next = Arc::new(AtomicU64::new(0));
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
        })
        .await?;
        drop(conn);
        serving.shutdown().await;
        Ok(best)
    })
}

/// Best rate over [`crate::remote::ROUNDS`] rounds, in bytes per second: each round,
/// `spawn` starts its tasks into a fresh set, which together move `bytes`, and the round
/// lasts from then until the last task ends (the first task error ends the measurement).
#[cfg(feature = "ucx")]
async fn best_round<E>(
    bytes: u64,
    mut spawn: impl FnMut(&mut tokio::task::JoinSet<Result<(), E>>),
) -> Result<f64>
where
    E: Into<anyhow::Error> + Send + 'static,
{
    let mut best = 0f64;
    for _ in 0..crate::remote::ROUNDS {
        let start = std::time::Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        spawn(&mut tasks);
        while let Some(done) = tasks.join_next().await {
            done.context("a UCX bench task")?.map_err(Into::into)?;
        }
        best = best.max(bytes as f64 / start.elapsed().as_secs_f64());
    }
    Ok(best)
}
