//! Re-replication, the tokio side: the loop that repairs this node's pages whose copies
//! died ([`RemoteService::run_repair`]), paced to `repair_bytes_per_s`, and one batch of
//! it ([`RemoteService::repair_once`]). The decisions are the brain's
//! ([`crate::placement::repair`]): which pages, which slots, where the new copies go. A
//! batch holds its pages from the scan to its end, so no client spills or discards one of
//! them meanwhile (a client's operation waits, [`RemoteService::claim`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_types::{NodeId, PageId};

use super::{MemberExtra, RemoteService};
use crate::placement::{Candidate, Held, Placement, RepairJob};
use crate::tier::RemoteError;

/// How often the repair loop looks for pages with a dead copy when it found none: every
/// 500 ms (a scan is skipped while the pool's members, states and epochs are unchanged
/// and nothing was left to do, but runs at least every [`REPAIR_RESCAN`]).
const REPAIR_IDLE: Duration = Duration::from_millis(500);
/// Longest time between two repair scans: 10 s (free capacity is not in the pool's
/// fingerprint: a repair that found no room retries this often).
const REPAIR_RESCAN: Duration = Duration::from_secs(10);
/// Most pages one repair batch copies: 64 (128 MiB of 2 MiB pages, read then written);
/// a batch is also at most a quarter second of `repair_bytes_per_s`.
const REPAIR_BATCH_PAGES_MAX: u64 = 64;

impl RemoteService {
    /// Re-replication until `cancel`: repairs batches of this node's pages whose copies
    /// died ([`RemoteService::repair_once`]), paced to `repair_bytes_per_s` (after a batch
    /// of N bytes it waits N / rate), scanning every [`REPAIR_IDLE`] while there is
    /// nothing to do. One batch at a time, each request taking one of its peer's
    /// [`crate::tier::REQUESTS_IN_FLIGHT_PER_PEER`] slots, so demand fetches keep the others.
    pub(crate) async fn run_repair(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        let rate = self.repair_bytes_per_s.max(1);
        let batch_pages = (rate / 4 / self.page_bytes.max(1)).clamp(1, REPAIR_BATCH_PAGES_MAX);
        let mut wait = REPAIR_IDLE;
        let mut fingerprint = None;
        let mut last_scan = Instant::now();
        let mut more = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            wait = REPAIR_IDLE;
            self.refresh_members().await;
            let pool = self.candidates();
            let now = pool_fingerprint(&pool);
            let due = more
                || fingerprint != Some(now)
                || self.brain().take_repair_dirty()
                || last_scan.elapsed() >= REPAIR_RESCAN;
            if !due {
                continue;
            }
            fingerprint = Some(now);
            last_scan = Instant::now();
            // A batch cut short by the shutdown leaves at most copies no record names
            // (deleted by nobody: the node is going) and reservations that lapse.
            let moved = tokio::select! {
                _ = cancel.cancelled() => return,
                moved = self.repair_once(&pool, batch_pages as usize) => moved,
            };
            more = moved > 0;
            if moved > 0 {
                wait = Duration::from_secs_f64(moved as f64 / rate as f64).max(REPAIR_PACE_MIN);
            }
        }
    }

    /// Reads each member's epoch, zone and the group-clock time it came up from the
    /// replicated state (the placement ramp and zones need them; the view lacks them).
    async fn refresh_members(&self) {
        let read = self
            .meta
            .read(|s| {
                s.members()
                    .map(|m| {
                        let zone = m.zone.as_deref().map(Arc::from);
                        (m.id, (m.epoch, zone, m.up_since_ms))
                    })
                    .collect::<HashMap<NodeId, MemberExtra>>()
            })
            .await;
        match read {
            Ok(extras) => *self.member_extras.lock().expect("member extras lock") = extras,
            Err(e) => tracing::debug!(error = %e, "could not read the members' zones"),
        }
    }

    /// One repair batch: up to `max_pages` of this node's pages with a dead copy are read
    /// from a live copy (checksum checked), then spilled into their dead slots on new
    /// holders (distinct from the live copies) and placed there. Returns the bytes copied.
    pub(crate) async fn repair_once(&self, pool: &[Candidate], max_pages: usize) -> u64 {
        let jobs = {
            let mut brain = self.brain();
            let jobs = brain.repair_jobs(pool, max_pages);
            brain.hold_for_repair(&jobs);
            jobs
        };
        // Ends the hold however the batch ends (a shutdown drops it mid-way).
        let _hold = RepairHold {
            service: self,
            jobs: &jobs,
        };
        let mut moved = 0u64;
        for batch in RepairJob::by_client(&jobs) {
            let client = batch[0].client;
            match self.repair_client(client, batch, pool).await {
                Ok(bytes) => moved += bytes,
                Err(e) => {
                    self.brain().repair_errors += 1;
                    tracing::debug!(client, error = %e, "repair batch failed; retried later");
                }
            }
        }
        moved
    }

    async fn repair_client(
        &self,
        client: u32,
        jobs: &[crate::placement::RepairJob],
        pool: &[Candidate],
    ) -> Result<u64, RemoteError> {
        let pages: Vec<PageId> = jobs.iter().map(|j| j.page).collect();
        let held: Vec<Option<Held>> = jobs.iter().map(|j| Some(j.live)).collect();
        let mut fetch =
            self.brain()
                .start_fetch(client, pages, &held, pool, self.zone.as_deref())?;
        self.run_fetch(&mut fetch, false).await;
        let items = Placement::repair_items(jobs, fetch.finish_partial());
        if items.is_empty() {
            return Ok(0);
        }
        let planned = self.plan_and_reserve(client, items, &[]).await?;
        if planned.is_empty() {
            return Ok(0);
        }
        let failures = self.move_pages(&planned).await;
        if let Some((_, e)) = failures.into_iter().next() {
            self.abandon(client, &planned).await;
            return Err(e);
        }
        if let Err(e) = self.place(client, &planned, false).await {
            self.drop_copies(client, &planned).await;
            return Err(e);
        }
        let stale = self.brain().repaired(client, &planned);
        self.delete_all_or_queue(stale).await;
        let bytes: u64 = planned.iter().map(|p| p.data.len() as u64).sum();
        tracing::debug!(client, bytes, copies = %super::copies_of(&planned), "repaired copies");
        Ok(bytes)
    }
}

/// Shortest pause between two repair batches: 10 ms (yields the links to demand fetches
/// even at a high `repair_bytes_per_s`).
const REPAIR_PACE_MIN: Duration = Duration::from_millis(10);

/// What the repair loop watches of the pool: members, their states and epochs.
fn pool_fingerprint(pool: &[Candidate]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for c in pool {
        (c.id, c.state, c.epoch.0, c.reachable).hash(&mut h);
    }
    h.finish()
}

/// A repair batch's hold on its pages ([`RemoteService::repair_once`]).
struct RepairHold<'a> {
    service: &'a RemoteService,
    jobs: &'a [RepairJob],
}

impl Drop for RepairHold<'_> {
    fn drop(&mut self) {
        self.service.brain().end_repair(self.jobs);
        self.service.repair_ended.notify_waiters();
    }
}
