//! `spillway status`: every node's `/status`, as a table or one JSON document.
//!
//! Nodes come from a pool directory (`cluster.json`) or from `--node host:port` (their
//! status addresses). A node that does not answer is shown as down; one that answers but
//! whose Raft log fails (`raft_healthy` false) is shown UNHEALTHY with the cause, and not
//! counted as fine in the summary line. The command fails (exit code 1) only if no node
//! answers. A `replication:` line sums what the answering nodes report of their spilled
//! pages: copies still to make after a holder died (under-replicated bytes), what
//! re-replication copied so far, and pages lost with every holder; a node with work left
//! gets a line of its own.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use spillway_client::fmt_bytes;
use spillway_cluster::launcher::status_targets;
use spillway_cluster::{ClusterSpec, PoolReport, query_pool};

use crate::cluster_cmd::DirArg;

/// Arguments of `spillway status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    dir: DirArg,
    /// A node's status address (its metrics_addr), instead of a pool directory; repeat
    /// for several nodes.
    #[arg(long = "node", value_name = "HOST:PORT", conflicts_with = "dir")]
    nodes: Vec<String>,
    /// Print one JSON document: {answering, raft_healthy, leader, term, leader_agreed,
    /// members, nodes: [{target, expected_id, up, error | status}]}.
    #[arg(long)]
    json: bool,
    /// Milliseconds each node has to answer.
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
}

/// Runs `spillway status`.
pub fn run_status(args: StatusArgs) -> Result<()> {
    let targets = if args.nodes.is_empty() {
        let dir = args.dir.resolve();
        status_targets(&ClusterSpec::load(&dir)?)
    } else {
        args.nodes.iter().map(|n| (n.clone(), None)).collect()
    };
    let report = query_pool(&targets, Duration::from_millis(args.timeout_ms));
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    if report.answering == 0 {
        bail!("none of the {} nodes answered", targets.len());
    }
    Ok(())
}

fn print_report(r: &PoolReport) {
    let leader = match (r.leader, r.leader_agreed) {
        (Some(l), true) => format!("leader node {l}"),
        (Some(l), false) => format!("node {l} claims to lead, not every node agrees"),
        (None, _) => "no leader".to_string(),
    };
    let unhealthy = match r.answering - r.raft_healthy.min(r.answering) {
        0 => String::new(),
        n => format!(", {n} of them UNHEALTHY"),
    };
    println!(
        "{} of {} nodes answering{unhealthy}; {leader}, term {}",
        r.answering,
        r.nodes.len(),
        r.term.map_or("-".to_string(), |t| t.to_string())
    );
    println!(
        "{:>4} {:<21} {:<9} {:>6} {:>5} {:>8} {:>7} {:>21} {:>7} {:>10} {:>10} {:>7}",
        "node",
        "status addr",
        "role",
        "leader",
        "term",
        "commit",
        "members",
        "host tier used/budget",
        "pages",
        "peer in",
        "peer out",
        "clients"
    );
    for n in &r.nodes {
        let id = n
            .status
            .as_ref()
            .map(|s| s.node_id)
            .or(n.expected_id)
            .map_or("?".to_string(), |i| i.to_string());
        match &n.status {
            Some(s) => println!(
                "{:>4} {:<21} {:<9} {:>6} {:>5} {:>8} {:>7} {:>21} {:>7} {:>10} {:>10} {:>7}{}",
                id,
                n.target,
                if s.raft_healthy { &s.role } else { "UNHEALTHY" },
                s.known_leader().map_or("-".to_string(), |l| l.to_string()),
                s.term,
                s.commit_index,
                s.members.len(),
                format!(
                    "{} / {}",
                    fmt_bytes(s.host_tier.used_bytes),
                    fmt_bytes(s.host_tier.budget_bytes)
                ),
                s.host_tier.pages,
                fmt_bytes(s.peer_bytes_in),
                fmt_bytes(s.peer_bytes_out),
                s.clients,
                match (s.raft_healthy, &s.raft_error) {
                    (true, _) => String::new(),
                    (false, Some(cause)) => format!("\n{:>4} Raft log failing: {cause}", ""),
                    (false, None) => format!("\n{:>4} Raft stopped (no cause given)", ""),
                }
            ),
            None => println!(
                "{:>4} {:<21} DOWN: {}",
                id,
                n.target,
                n.error.as_deref().unwrap_or("no answer")
            ),
        }
    }
    print_replication(r);
    if !r.members.is_empty() {
        println!("members:");
        println!(
            "{:>4} {:<21} {:<8} {:<7} {:>12} {:>12} {:>12}",
            "id", "peer addr", "state", "raft", "capacity", "used", "reserved"
        );
        for m in &r.members {
            println!(
                "{:>4} {:<21} {:<8} {:<7} {:>12} {:>12} {:>12}",
                m.id,
                m.addr,
                m.state,
                if m.raft.is_empty() { "?" } else { &m.raft },
                fmt_bytes(m.capacity_bytes),
                fmt_bytes(m.used_bytes),
                fmt_bytes(m.reserved_bytes)
            );
        }
    }
}

/// The replication summary: each answering node repairs its own pages, so the pool's
/// figures are the sums of theirs.
fn print_replication(r: &PoolReport) {
    let statuses: Vec<_> = r.nodes.iter().filter_map(|n| n.status.as_ref()).collect();
    if statuses.is_empty() {
        return;
    }
    let replicas: Vec<u8> = {
        let mut v: Vec<u8> = statuses.iter().map(|s| s.remote.replicas).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let under: u64 = statuses
        .iter()
        .map(|s| s.remote.under_replicated_bytes)
        .sum();
    let repaired: u64 = statuses.iter().map(|s| s.remote.repaired_bytes).sum();
    let lost: u64 = statuses.iter().map(|s| s.remote.lost_pages).sum();
    let replicas = replicas
        .iter()
        .map(u8::to_string)
        .collect::<Vec<_>>()
        .join("/");
    let state = if under == 0 && lost == 0 {
        "complete".to_string()
    } else {
        "IN PROGRESS".to_string()
    };
    println!(
        "replication: replicas {replicas}; under-replicated {} ({state}), re-replicated {} so far; {lost} pages lost",
        fmt_bytes(under),
        fmt_bytes(repaired)
    );
    for s in statuses {
        let rs = &s.remote;
        if rs.under_replicated_bytes > 0 || rs.lost_pages > 0 {
            println!(
                "{:>4} under-replicated {} in {} pages, re-replicated {}, {} pages lost",
                s.node_id,
                fmt_bytes(rs.under_replicated_bytes),
                rs.under_replicated_pages,
                fmt_bytes(rs.repaired_bytes),
                rs.lost_pages
            );
        }
    }
}
