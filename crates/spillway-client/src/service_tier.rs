//! A pool's remote tier through a node of the same process: [`ServiceTier`] hands the
//! pool's remote ops to `spillway-node`'s [`RemoteService`], which stores the pages on the
//! node's peers over QUIC. The multi-node demo and `spillway replay --nodes` use it; a
//! separate client process uses the node's Unix socket instead ([`crate::daemon`]).
//! Behind the `node` feature, so an SDK user who talks to a node daemon does not build a
//! node into the process.
//!
//! A spill reads the page's slot into a buffer on the calling thread (the pool holds the
//! slot until the op completes), then the service sends it; a fetch writes the bytes the
//! service returns into the slot before completing. Every op completes exactly once.

use std::sync::Arc;

use bytes::Bytes;
use spillway_device::Device;
use spillway_node::remote::RemoteService;
use spillway_types::PageId;

use crate::remote::{
    DeviceFault, RemoteCompletion, RemoteError, RemoteFactory, RemoteOp, RemoteOpKind, RemoteSink,
    RemoteTier,
};

/// The bandwidth a [`ServiceTier`] claims before its first op is measured: 1 GB/s, about
/// what loopback QUIC moves here (`bench/RESULTS.md`, remote throughput); measured ops take
/// over from the first completion.
pub const SERVICE_TIER_BYTES_PER_S_HINT: f64 = 1e9;

/// The remote tier of a pool whose node runs in this process.
pub struct ServiceTier {
    service: Arc<RemoteService>,
    runtime: tokio::runtime::Handle,
    device: Arc<dyn Device>,
    sink: RemoteSink,
    client: u32,
    capacity_bytes: u64,
    describe: String,
}

impl ServiceTier {
    /// A factory for [`crate::PoolBuilder::remote`]: the pool's pages go through `service` as
    /// local client `client`, on `runtime`, within `capacity_bytes`.
    pub fn factory(
        service: Arc<RemoteService>,
        runtime: tokio::runtime::Handle,
        client: u32,
        capacity_bytes: u64,
        describe: String,
    ) -> RemoteFactory {
        Box::new(move |device, sink| {
            Ok(Arc::new(ServiceTier {
                service,
                runtime,
                device,
                sink,
                client,
                capacity_bytes,
                describe,
            }) as Arc<dyn RemoteTier>)
        })
    }
}

impl RemoteTier for ServiceTier {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn bandwidth_hint_bytes_per_s(&self) -> f64 {
        SERVICE_TIER_BYTES_PER_S_HINT
    }

    fn submit(&self, op: RemoteOp) {
        let (service, sink, client) = (self.service.clone(), self.sink.clone(), self.client);
        match op.kind {
            RemoteOpKind::Spill => {
                let mut data = vec![0u8; op.bytes as usize];
                if let Err(e) = self.device.read_host(op.slot, 0, &mut data) {
                    // Not inside `submit`'s caller's lock: complete from the runtime.
                    self.runtime.spawn(async move {
                        sink(RemoteCompletion {
                            id: op.id,
                            result: Err(RemoteError::Slot {
                                slot: op.slot,
                                fault: DeviceFault::new(e),
                            }),
                        });
                    });
                    return;
                }
                self.runtime.spawn(async move {
                    let result = service
                        .spill(client, vec![(op.page, Bytes::from(data))])
                        .await
                        .map_err(RemoteError::tier);
                    sink(RemoteCompletion { id: op.id, result });
                });
            }
            RemoteOpKind::Fetch => {
                let device = self.device.clone();
                self.runtime.spawn(async move {
                    let result = match service.fetch(client, vec![op.page]).await {
                        Ok(pages) => match pages.first() {
                            Some(data) if data.len() as u64 == op.bytes => device
                                .write_host(op.slot, 0, data)
                                .map_err(|e| RemoteError::Slot {
                                    slot: op.slot,
                                    fault: DeviceFault::new(e),
                                }),
                            Some(data) => Err(RemoteError::WrongLength {
                                page: op.page,
                                got_bytes: data.len() as u64,
                                expected_bytes: op.bytes,
                            }),
                            None => Err(RemoteError::NotHeld { page: op.page }),
                        },
                        Err(e) => Err(RemoteError::tier(e)),
                    };
                    sink(RemoteCompletion { id: op.id, result });
                });
            }
        }
    }

    fn discard(&self, pages: Vec<PageId>) {
        let (service, client) = (self.service.clone(), self.client);
        self.runtime.spawn(async move {
            if let Err(e) = service.discard(client, pages).await {
                tracing::warn!(error = %e, "discarding remote pages failed");
            }
        });
    }
}
