//! The clients' workload, what each page should hold, and the checks of the run.
//!
//! Each node has one client (number 1) with [`BUFFERS`] buffers of [`PAGES_PER_BUFFER`]
//! pages. A page is at home (in the client's memory), in the remote tier (spilled and
//! acknowledged: the client dropped its bytes), or lost (every copy's holder died, which
//! the loss rule allows). A turn of a client writes and spills a few home pages (each a
//! new version with new bytes), fetches a few remote ones back and compares every byte
//! with the version it spilled, or discards a few. A crash of the client's node ends the
//! client (its pages go with it, as a real client's link does); its next incarnation
//! starts a new client, which reuses the same page ids.

use std::collections::BTreeMap;

use bytes::Bytes;
use spillway_types::wire::page_checksum;
use spillway_types::{BufferId, NodeId, PageId};

use super::driver::{self, HOUSEKEEPING_EVERY_MS, REPAIR_EVERY_MS};
use super::world::{OpError, PAGE_BYTES, World};
use super::{REPAIR_BOUND_MS, ViolationKind};
use crate::placement::RepairJob;
use crate::tier::{RemoteError, remote_page_id};

/// Buffers per client.
const BUFFERS: u64 = 3;
/// Pages per buffer (24 pages a client).
const PAGES_PER_BUFFER: u32 = 8;
/// The client's number on its node.
pub(super) const CLIENT: u32 = 1;
/// By this time the pool has formed and every node announced itself (no fault starts
/// before 3 s).
const FORMED_MS: u64 = 2_000;
/// Pages a spill, fetch or discard takes at most.
const PAGES_PER_OP: usize = 6;

/// Where a page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Where {
    Home,
    Remote,
    Lost,
}

#[derive(Clone, Debug)]
pub(super) struct PageState {
    version: u64,
    data: Bytes,
    checksum: u64,
    /// The nodes that held its latest version at the last check (after each turn).
    seen_on: Vec<NodeId>,
    at: Where,
}

/// What came of a client's spill.
pub(super) enum Spilled {
    Done,
    Failed(RemoteError),
    /// Refused while a repair batch held some of its pages.
    Waited,
}

/// One node's client.
pub(super) struct Client {
    node: NodeId,
    generation: u64,
    pages: BTreeMap<PageId, PageState>,
}

impl Client {
    pub(super) fn new(node: NodeId, generation: u64) -> Self {
        let mut c = Client {
            node,
            generation,
            pages: BTreeMap::new(),
        };
        for b in 1..=BUFFERS {
            for index in 0..PAGES_PER_BUFFER {
                let page = PageId {
                    buffer: BufferId(b),
                    index,
                };
                let data = c.data(page, 0);
                c.pages.insert(
                    page,
                    PageState {
                        seen_on: Vec::new(),
                        version: 0,
                        checksum: page_checksum(&data),
                        data,
                        at: Where::Home,
                    },
                );
            }
        }
        c
    }

    /// The client died with its node.
    pub(super) fn crashed(&mut self) {
        self.pages.clear();
    }

    /// The bytes of version `version` of `page`: 256 B to 4 KiB, a whole page one time
    /// in eight; fixed by the page, the version and the client's incarnation.
    fn data(&self, page: PageId, version: u64) -> Bytes {
        let mut rng = spillway_meta::rng::SimRng::new(
            self.node.0 << 48
                ^ self.generation << 40
                ^ page.buffer.0 << 32
                ^ u64::from(page.index) << 20
                ^ version,
        );
        let len = if rng.below(8) == 0 {
            PAGE_BYTES
        } else {
            rng.between(256, 4096)
        } as usize;
        super::random_bytes(&mut rng, len)
    }

    fn at(&self, at: Where) -> Vec<PageId> {
        self.pages
            .iter()
            .filter(|(_, p)| p.at == at)
            .map(|(id, _)| *id)
            .collect()
    }
}

impl World {
    /// The whole run: the pool forms, the clients work under the faults for the run's
    /// length, every fault heals, and the end checks run.
    pub(super) fn run(&mut self) {
        let formed = self.now_us() + 10_000_000;
        self.run_until(formed, |w| w.c.leader().is_some());
        let end = self.config.length_ms * 1000;
        while self.now_us() < end {
            self.turn(true);
            let think = self.work_rng.between(1, 40);
            self.idle_ms(think);
        }
        self.log("every fault heals");
        self.heal_all();
        self.finish();
    }

    /// One node's turn: its announcement until it lands, else its housekeeping or its
    /// repair round when due, else (when `work`) one client operation.
    pub(super) fn turn(&mut self, work: bool) {
        let ids: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.running && !n.paused)
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return;
        }
        let id = ids[self.work_rng.below(ids.len() as u64) as usize];
        let generation = self.nodes[&id].generation;
        // A panic in this node's own code (its brain, at a failpoint) is its crash.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.node_turn(id, generation, work)
        }))
        .unwrap_or_else(|_| {
            self.crashed_at_failpoint(id);
            Err(OpError::Crashed)
        });
        if let Err(OpError::Crashed) = result {
            self.log(format!("{id}'s operation ended with its crash"));
        }
        self.check_pages_held();
        self.check_raft();
    }

    fn node_turn(&mut self, id: NodeId, generation: u64, work: bool) -> Result<(), OpError> {
        let now = self.now_us();
        let n = &self.nodes[&id];
        if !n.announced {
            driver::announce(self, id, generation).map(|done| {
                if done {
                    self.log(format!("{id} announced its incarnation"));
                    if let Some(n) = self.nodes.get_mut(&id) {
                        n.announced = true;
                    }
                }
            })
        } else if n.next_housekeeping_us <= now {
            self.nodes
                .get_mut(&id)
                .expect("running")
                .next_housekeeping_us = now + HOUSEKEEPING_EVERY_MS * 1000;
            driver::housekeeping(self, id, generation)
        } else if n.next_repair_us <= now {
            self.nodes.get_mut(&id).expect("running").next_repair_us = now + REPAIR_EVERY_MS * 1000;
            driver::repair_once(self, id, generation).map(|copies| {
                if copies > 0 {
                    self.counts.pages_repaired += copies;
                    self.log(format!("{id} repaired {copies} copies"));
                }
            })
        } else if work && self.work_rng.below(3) == 0 {
            self.core_op(id, generation, false);
            Ok(())
        } else if work {
            self.client_op(id, generation)
        } else {
            Ok(())
        }
    }

    /// `count` pages of `pages` drawn at random (at least one when there is one).
    fn draw(&mut self, mut pages: Vec<PageId>, count: usize) -> Vec<PageId> {
        for i in (1..pages.len()).rev() {
            let j = self.work_rng.below(i as u64 + 1) as usize;
            pages.swap(i, j);
        }
        pages.truncate(count);
        pages.sort();
        pages
    }

    fn client_op(&mut self, id: NodeId, generation: u64) -> Result<(), OpError> {
        let pick = self.work_rng.below(100);
        let count = 1 + self.work_rng.below(PAGES_PER_OP as u64) as usize;
        let client = &self.nodes[&id].client;
        let (home, remote) = (client.at(Where::Home), client.at(Where::Remote));
        if pick < 45 && !home.is_empty() {
            let pages = self.draw(home, count);
            self.spill_pages(id, generation, pages).map(drop)
        } else if pick < 85 && !remote.is_empty() {
            let pages = self.draw(remote, count);
            match driver::fetch(self, id, generation, CLIENT, pages.clone()) {
                Ok(bytes) => {
                    self.counts.fetches_ok += 1;
                    self.log(format!("{id} fetched {pages:?}"));
                    self.verify(id, &pages, &bytes);
                    Ok(())
                }
                Err(OpError::Remote(e)) => {
                    self.counts.fetches_failed += 1;
                    self.log(format!("{id} could not fetch {pages:?}: {e}"));
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else if !remote.is_empty() {
            let pages = self.draw(remote, count.min(4));
            self.discard_pages(id, generation, pages)
        } else {
            Ok(())
        }
    }

    /// A client operation of `id` in the middle of its own repair batch (between the
    /// batch's read and its writes), as the tokio driver lets one run while a repair
    /// awaits: one time in three, either the client writes and spills the batch's pages
    /// it holds at home (a fetched page keeps its remote copies) or discards its remote
    /// ones, or it does what a turn would. The node's claims (`Placement::claim`) must
    /// refuse an operation on pages the batch holds; without them, the batch's old bytes
    /// would land over the new spill's copies.
    pub(super) fn client_op_during_repair(
        &mut self,
        id: NodeId,
        generation: u64,
        client: u32,
        jobs: &[RepairJob],
    ) -> Result<(), OpError> {
        if self.nested || client != CLIENT || self.work_rng.below(3) != 0 {
            return Ok(());
        }
        self.nested_op(|w| w.op_on_batch(id, generation, jobs))
    }

    /// Runs `op` as an operation inside another of its node: no deeper nesting while it
    /// runs (`World::nested`).
    fn nested_op<T>(&mut self, op: impl FnOnce(&mut World) -> T) -> T {
        self.nested = true;
        let out = op(self);
        self.nested = false;
        out
    }

    fn op_on_batch(
        &mut self,
        id: NodeId,
        generation: u64,
        jobs: &[RepairJob],
    ) -> Result<(), OpError> {
        self.log(format!(
            "{id}'s client acts during a repair batch of {:?}",
            jobs.iter().map(|j| j.page).collect::<Vec<_>>()
        ));
        if self.work_rng.below(2) == 0 {
            return self.client_op(id, generation);
        }
        let c = &self.nodes[&id].client;
        let (mut home, mut remote) = (Vec::new(), Vec::new());
        for j in jobs {
            match c.pages.get(&j.page).map(|p| p.at) {
                Some(Where::Home) => home.push(j.page),
                Some(Where::Remote) => remote.push(j.page),
                _ => {}
            }
        }
        if !home.is_empty() {
            self.spill_pages(id, generation, home).map(drop)
        } else if !remote.is_empty() {
            self.discard_pages(id, generation, remote)
        } else {
            Ok(())
        }
    }

    /// A repair batch of `id` in the middle of its client's spill (its copies written,
    /// not yet placed), as the tokio driver's repair task may run then: one time in six.
    /// A repair scan must leave the spill's claimed pages out.
    pub(super) fn repair_during_spill(
        &mut self,
        id: NodeId,
        generation: u64,
    ) -> Result<(), OpError> {
        if self.nested || self.work_rng.below(6) != 0 {
            return Ok(());
        }
        self.log(format!("{id} runs a repair batch during a spill"));
        let copies = self.nested_op(|w| driver::repair_once(w, id, generation))?;
        if copies > 0 {
            self.counts.pages_repaired += copies;
            self.log(format!("{id} repaired {copies} copies"));
        }
        Ok(())
    }

    /// The client writes `pages` (new versions), then spills them.
    fn spill_pages(
        &mut self,
        id: NodeId,
        generation: u64,
        pages: Vec<PageId>,
    ) -> Result<Spilled, OpError> {
        let mut out = Vec::new();
        let c = &mut self.nodes.get_mut(&id).expect("running").client;
        for p in &pages {
            let version = c.pages[p].version + 1;
            let data = c.data(*p, version);
            let state = c.pages.get_mut(p).expect("drawn");
            state.version = version;
            state.seen_on.clear();
            state.checksum = page_checksum(&data);
            state.data = data.clone();
            out.push((*p, data));
        }
        match driver::spill(self, id, generation, CLIENT, out) {
            Ok(()) => {
                self.counts.spills_ok += 1;
                self.log(format!("{id} spilled {pages:?}"));
                self.mark_all(id, &pages, Where::Remote);
                Ok(Spilled::Done)
            }
            Err(OpError::Remote(e)) => {
                self.counts.spills_failed += 1;
                self.log(format!("{id} could not spill {pages:?}: {e}"));
                Ok(Spilled::Failed(e))
            }
            Err(OpError::Busy) => {
                self.counts.ops_waited += 1;
                Ok(Spilled::Waited)
            }
            Err(OpError::Crashed) => Err(OpError::Crashed),
        }
    }

    /// The client discards `pages`' remote copies.
    fn discard_pages(
        &mut self,
        id: NodeId,
        generation: u64,
        pages: Vec<PageId>,
    ) -> Result<(), OpError> {
        // The client no longer needs the remote copies from the moment it discards them
        // (a buffer freed or written anew), whatever the discard's outcome.
        self.mark_all(id, &pages, Where::Home);
        match driver::discard(self, id, generation, CLIENT, pages.clone()) {
            Ok(()) => {
                self.counts.discards_ok += 1;
                self.log(format!("{id} discarded {pages:?}"));
                Ok(())
            }
            Err(OpError::Busy) => {
                // Refused before anything moved: the pages stay remote.
                self.counts.ops_waited += 1;
                self.mark_all(id, &pages, Where::Remote);
                Ok(())
            }
            Err(OpError::Remote(e)) => {
                self.log(format!("{id} could not discard {pages:?}: {e}"));
                Ok(())
            }
            Err(OpError::Crashed) => Err(OpError::Crashed),
        }
    }

    fn mark_all(&mut self, id: NodeId, pages: &[PageId], at: Where) {
        let c = &mut self.nodes.get_mut(&id).expect("running").client;
        for p in pages {
            c.pages.get_mut(p).expect("drawn").at = at;
        }
    }

    /// Compares fetched bytes with each page's latest acknowledged write; the pages are
    /// home again.
    fn verify(&mut self, id: NodeId, pages: &[PageId], bytes: &[Bytes]) {
        let mut wrong = Vec::new();
        let c = &mut self.nodes.get_mut(&id).expect("running").client;
        for (p, b) in pages.iter().zip(bytes) {
            let state = c.pages.get_mut(p).expect("fetched");
            if state.data != *b {
                wrong.push(format!(
                    "{p} version {} ({} bytes, checksum {:#x}) came back as {} bytes, checksum {:#x}",
                    state.version,
                    state.data.len(),
                    state.checksum,
                    b.len(),
                    page_checksum(b)
                ));
            }
            state.at = Where::Home;
        }
        self.counts.pages_verified += pages.len() as u64;
        if !wrong.is_empty() {
            self.violation(
                ViolationKind::WrongBytes,
                format!("{id}'s client read {}", wrong.join("; ")),
            );
        }
    }

    /// The nodes whose host store holds `origin`'s page `page` with `checksum` (among
    /// running nodes, and `also` whatever its state).
    fn copies_of(
        &self,
        origin: NodeId,
        page: PageId,
        checksum: u64,
        also: Option<NodeId>,
    ) -> Vec<NodeId> {
        let remote = remote_page_id(origin, CLIENT, page);
        self.nodes
            .iter()
            .filter(|(id, n)| n.running || Some(**id) == also)
            .filter(|(_, n)| {
                n.store
                    .get(origin, &[remote])
                    .is_ok_and(|(found, _)| found.first().is_some_and(|p| p.checksum == checksum))
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every remote page of a running client: (its node, its id, its checksum).
    fn remote_pages(&self) -> Vec<(NodeId, PageId, u64)> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.running)
            .flat_map(|(&id, n)| {
                n.client
                    .pages
                    .iter()
                    .filter(|(_, p)| p.at == Where::Remote)
                    .map(move |(&page, p)| (id, page, p.checksum))
            })
            .collect()
    }

    fn mark(&mut self, node: NodeId, page: PageId, at: Where) {
        if let Some(p) = self
            .nodes
            .get_mut(&node)
            .and_then(|n| n.client.pages.get_mut(&page))
        {
            p.at = at;
        }
    }

    /// Nodes down within the repair bound: not running now, crashed within it, or (in
    /// the pool's view: the leader's state, else the most advanced running node's)
    /// declared down now or back up from down
    /// within it. A spill may leave out a copy for want of up members, so a member the
    /// pool declared down counts as one of the holders that went down.
    pub(super) fn recently_down(&self) -> Vec<NodeId> {
        let since = self.now_us().saturating_sub(REPAIR_BOUND_MS * 1000);
        let since_ms = since / 1000;
        // The leader's state, or without a leader the most advanced running node's.
        let view = self.c.leader().or_else(|| {
            self.c
                .live_nodes()
                .into_iter()
                .max_by_key(|&n| (self.c.node(n).state().applied_index(), std::cmp::Reverse(n)))
        });
        let declared: Vec<NodeId> = view
            .map(|l| {
                self.c
                    .node(l)
                    .state()
                    .members()
                    .filter(|m| {
                        m.state == spillway_meta::MemberState::Down
                            // The first announcement (at 0.5 s) is a start, not a return.
                            || (m.up_since_ms >= since_ms && m.up_since_ms > FORMED_MS)
                    })
                    .map(|m| m.id)
                    .collect()
            })
            .unwrap_or_default();
        self.nodes
            .iter()
            .filter(|(id, n)| {
                !n.running
                    || declared.contains(id)
                    || self
                        .crashed_at
                        .get(id)
                        .is_some_and(|t| t.iter().any(|&t| t >= since))
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Whether losing `node`'s `page` is allowed with `down` nodes down lately: `replicas`
    /// nodes or more went down. (A stricter rule, every holder of the last check among
    /// them, fails on an artefact of this simulation: operations run one at a time, so
    /// an operation waiting out a peer's grace holds back every node's repairs and
    /// announcements; the holders of the last check can be long stale. Running the
    /// nodes' operations concurrently comes first.)
    fn seen_on(&self, node: NodeId, page: PageId) -> Vec<NodeId> {
        self.nodes[&node]
            .client
            .pages
            .get(&page)
            .map(|p| p.seen_on.clone())
            .unwrap_or_default()
    }

    pub(super) fn loss_allowed(&self, down: &[NodeId]) -> bool {
        down.len() >= usize::from(self.config.replicas)
    }

    /// At the crash of `dead` (its store still there): the remote pages whose last copy
    /// it held. Lost as allowed when `replicas` nodes or more went down within the
    /// repair bound, every holder of the last check among them; a violation otherwise.
    pub(super) fn pages_lost_with(&mut self, dead: NodeId) {
        let down_nodes = self.recently_down();
        let down = down_nodes.len();
        let replicas = usize::from(self.config.replicas);
        for (node, page, checksum) in self.remote_pages() {
            let copies = self.copies_of(node, page, checksum, Some(dead));
            if copies != [dead] {
                continue;
            }
            let allowed = self.loss_allowed(&down_nodes);
            self.mark(node, page, Where::Lost);
            if allowed {
                self.counts.pages_lost_allowed += 1;
                self.log(format!(
                    "{node}'s {page} lost with {dead} ({down} nodes down lately)"
                ));
            } else {
                self.violation(
                    ViolationKind::PageLost,
                    format!(
                        "{node}'s {page} had its last copy on {dead}, which crashed with {down} node(s) down within {REPAIR_BOUND_MS} ms ({down_nodes:?}; replicas {replicas}; held on {:?} at the last check)",
                        self.seen_on(node, page)
                    ),
                );
            }
        }
    }

    /// Every acknowledged remote page is held by some running node, unless the loss rule
    /// allows it (a copy may die between its put and the spill's acknowledgement); the
    /// holders found are remembered for the rule.
    fn check_pages_held(&mut self) {
        let mut down_nodes = None;
        let replicas = usize::from(self.config.replicas);
        for (node, page, checksum) in self.remote_pages() {
            let copies = self.copies_of(node, page, checksum, None);
            if !copies.is_empty() {
                if let Some(p) = self
                    .nodes
                    .get_mut(&node)
                    .and_then(|n| n.client.pages.get_mut(&page))
                {
                    p.seen_on = copies;
                }
                continue;
            }
            let down_nodes = down_nodes
                .get_or_insert_with(|| self.recently_down())
                .clone();
            let down = down_nodes.len();
            let allowed = self.loss_allowed(&down_nodes);
            self.mark(node, page, Where::Lost);
            if allowed {
                self.counts.pages_lost_allowed += 1;
                self.log(format!(
                    "{node}'s {page} held by no node ({down} nodes down lately)"
                ));
            } else {
                self.violation(
                    ViolationKind::PageLost,
                    format!("{node}'s {page} (acknowledged) is held by no node, with {down} node(s) down within {REPAIR_BOUND_MS} ms ({down_nodes:?}; replicas {replicas}; held on {:?} at the last check)", self.seen_on(node, page)),
                );
            }
        }
    }

    fn check_raft(&mut self) {
        if let Err(e) = self.c.check_consistency() {
            self.violation(ViolationKind::RaftDiverged, e.reason);
        }
    }

    /// Copies wanted per page: `replicas`, or fewer when the pool has fewer other nodes.
    fn copies_wanted(&self) -> usize {
        usize::from(self.config.replicas).min(self.nodes.len() - 1)
    }

    /// After every fault healed: within the progress bound, every node is back and
    /// announced, every remote page has its copies, the directory agrees with the
    /// holders, and every remote page reads back with its bytes.
    fn finish(&mut self) {
        let deadline = self.now_us() + self.config.progress_bound_ms * 1000;
        let wanted = self.copies_wanted();
        let settled = |w: &World| {
            w.c.leader().is_some()
                && w.nodes.values().all(|n| n.running && n.announced)
                && w.remote_pages()
                    .into_iter()
                    .all(|(n, p, c)| w.copies_of(n, p, c, None).len() >= wanted)
        };
        while !settled(self) && self.now_us() < deadline {
            self.turn(false);
            self.idle_ms(20);
        }
        if !settled(self) {
            let short: Vec<String> = self
                .remote_pages()
                .into_iter()
                .filter_map(|(n, p, c)| {
                    let copies = self.copies_of(n, p, c, None);
                    (copies.len() < wanted).then(|| format!("{n}'s {p} on {copies:?}"))
                })
                .collect();
            let down: Vec<NodeId> = self
                .nodes
                .iter()
                .filter(|(_, n)| !(n.running && n.announced))
                .map(|(id, _)| *id)
                .collect();
            self.violation(
                ViolationKind::NoProgress,
                format!(
                    "{} ms after the faults healed: leader {:?}, nodes not back {down:?}, pages short of {wanted} copies: {}",
                    self.config.progress_bound_ms,
                    self.c.leader(),
                    short.join(", ")
                ),
            );
        }
        self.check_directory();
        self.check_spills_resume(deadline);
        // Every page reads back, byte for byte.
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            let generation = self.nodes[&id].generation;
            loop {
                let remote = self.nodes[&id].client.at(Where::Remote);
                if remote.is_empty() || self.now_us() >= deadline + 30_000_000 {
                    if !remote.is_empty() {
                        self.violation(
                            ViolationKind::NoProgress,
                            format!("{id}'s client cannot read back {remote:?}"),
                        );
                    }
                    break;
                }
                let pages: Vec<PageId> = remote.into_iter().take(PAGES_PER_OP).collect();
                match driver::fetch(self, id, generation, CLIENT, pages.clone()) {
                    Ok(bytes) => {
                        self.counts.fetches_ok += 1;
                        self.verify(id, &pages, &bytes);
                    }
                    Err(e) => {
                        self.counts.fetches_failed += 1;
                        self.log(format!("{id} could not fetch {pages:?} at the end: {e:?}"));
                        self.idle_ms(500);
                    }
                }
            }
        }
        // Every core client reads each of its buffers back once.
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            let generation = self.nodes[&id].generation;
            self.core_op(id, generation, true);
        }
        self.check_raft();
        self.log(format!(
            "end: {} events, {} pages verified, {} lost as allowed",
            self.counts.events, self.counts.pages_verified, self.counts.pages_lost_allowed
        ));
    }

    /// After every fault healed, each node's client can spill again within the progress
    /// bound: a spill goes through, or the pool says it has no room (found by the clock
    /// faults: one node's clock minutes ahead stamped the group's clock forward, and every
    /// other node's reservations expired on arrival for as long).
    fn check_spills_resume(&mut self, deadline_us: u64) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            let generation = self.nodes[&id].generation;
            loop {
                let home = self.nodes[&id].client.at(Where::Home);
                if home.is_empty() {
                    break;
                }
                let pages: Vec<PageId> = home.into_iter().take(PAGES_PER_OP).collect();
                let error = match self.spill_pages(id, generation, pages) {
                    Ok(Spilled::Done) | Err(_) => break, // Err: a crash at a failpoint
                    Ok(Spilled::Failed(RemoteError::NoRoom { .. })) => break,
                    Ok(Spilled::Failed(e)) => e.to_string(),
                    Ok(Spilled::Waited) => "waiting for a repair batch".into(),
                };
                if self.now_us() >= deadline_us {
                    self.violation(
                        ViolationKind::NoProgress,
                        format!("{id}'s client cannot spill after the faults healed: {error}"),
                    );
                    break;
                }
                // The nodes' background work (pending deletes, repairs) goes on meanwhile.
                let retry_at = self.now_us() + 500_000;
                while self.now_us() < retry_at {
                    self.turn(false);
                    self.idle_ms(20);
                }
            }
        }
    }

    /// Every live directory record (its holder up, at the recorded epoch) of a remote
    /// page, in the leader's state, names a holder that has the page's bytes.
    fn check_directory(&mut self) {
        let Some(leader) = self.c.leader() else {
            return;
        };
        let mut wrong = Vec::new();
        for (node, page, checksum) in self.remote_pages() {
            let holders: Vec<NodeId> = {
                let meta = self.c.node(leader);
                let s = meta.state();
                s.holders_of(remote_page_id(node, CLIENT, page))
                    .into_iter()
                    .filter(|(_, _, h)| {
                        s.member(h.node).is_some_and(|m| {
                            m.epoch == h.epoch && m.state != spillway_meta::MemberState::Down
                        })
                    })
                    .map(|(_, _, h)| h.node)
                    .collect()
            };
            let copies = self.copies_of(node, page, checksum, None);
            for h in holders {
                if !copies.contains(&h) {
                    wrong.push(format!(
                        "{node}'s {page} recorded on {h}, held on {copies:?}"
                    ));
                }
            }
        }
        if !wrong.is_empty() {
            self.violation(ViolationKind::DirectoryDisagrees, wrong.join("; "));
        }
    }
}
