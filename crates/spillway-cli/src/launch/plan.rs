//! What `spillway launch` will do on this host, computed without touching anything: the
//! node id, ports, voters, paths. `--dry-run` prints it ([`Plan::describe`]).

use std::path::{Path, PathBuf};

use spillway_node::membership::voters_wanted;

use super::env::{Hosts, Placement};

/// The plan of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Where this rank stands.
    pub placement: Placement,
    /// This host's node id: host index + 1.
    pub node_id: u64,
    /// Host indices of the Raft voters: the first 3 (5 from 5 hosts on).
    pub voters: Vec<usize>,
    /// Every node's peer port (UDP, QUIC).
    pub peer_port: u16,
    /// Every node's `/status` port (TCP): the next one.
    pub metrics_port: u16,
    /// Host 0's bootstrap endpoint, where the others join (UDP, QUIC): the one after.
    pub bootstrap_port: u16,
    /// The directory the hosts share (join tokens, the barrier).
    pub shared_dir: PathBuf,
    /// This host's run directory: node config, log, data, client socket, rank markers.
    pub run_dir: PathBuf,
    /// The job's join tokens and end-of-job barrier, in the shared directory.
    pub rendezvous_dir: PathBuf,
    /// The node's host tier in bytes.
    pub host_budget: u64,
    /// The job's command.
    pub command: Vec<String>,
}

/// Host indices of the voters among `hosts` hosts: the first 3 (5 from 5 hosts on),
/// as the pool promotes its learners (lowest node id first).
pub fn voters(hosts: usize) -> Vec<usize> {
    (0..hosts.min(voters_wanted(hosts))).collect()
}

/// A name safe as one path component.
fn component(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Plan {
    /// The plan for `placement`.
    pub fn new(
        placement: Placement,
        shared_dir: &Path,
        run_base: &Path,
        peer_port: u16,
        host_budget: u64,
        command: Vec<String>,
    ) -> Plan {
        let node_id = placement.host_index as u64 + 1;
        let key = component(&placement.job_key);
        Plan {
            voters: voters(placement.hosts.len()),
            run_dir: run_base.join(format!("spillway-{key}-node{node_id}")),
            rendezvous_dir: shared_dir.join("launch").join(&key),
            shared_dir: shared_dir.to_path_buf(),
            node_id,
            peer_port,
            metrics_port: peer_port.saturating_add(1),
            bootstrap_port: peer_port.saturating_add(2),
            host_budget,
            placement,
            command,
        }
    }

    /// This host's client socket (`SPILLWAY_SOCKET` of the job).
    pub fn client_socket(&self) -> PathBuf {
        self.run_dir.join("client.sock")
    }

    /// Whether this rank starts the host's node.
    pub fn starts_node(&self) -> bool {
        self.placement.local_rank == 0
    }

    /// What `--dry-run` prints.
    pub fn describe(&self) -> String {
        let p = &self.placement;
        let hosts = match &p.hosts {
            Hosts::Named(h) => h.join(","),
            Hosts::Count { count, first } => {
                format!("{count} hosts, host 0 at {first}")
            }
        };
        let role = if self.starts_node() {
            "starts the node, runs the job, stops the node when the host's last rank exits"
        } else {
            "waits for the node's socket, runs the job"
        };
        let voters: Vec<String> = self.voters.iter().map(|v| v.to_string()).collect();
        format!(
            "environment:   {}\n\
             hosts:         {hosts}\n\
             this host:     index {} (node {}), local rank {} of {}\n\
             role:          {role}\n\
             raft voters:   host indices {}\n\
             ports:         peers {} (udp), /status {} (tcp), joins {} (udp, host 0)\n\
             host tier:     {} bytes\n\
             shared dir:    {}\n\
             run dir:       {}\n\
             job dir:       {}\n\
             job:           SPILLWAY_SOCKET={} {}\n",
            p.source,
            p.host_index,
            self.node_id,
            p.local_rank,
            p.local_world_size,
            voters.join(","),
            self.peer_port,
            self.metrics_port,
            self.bootstrap_port,
            self.host_budget,
            self.shared_dir.display(),
            self.run_dir.display(),
            self.rendezvous_dir.display(),
            self.client_socket().display(),
            self.command.join(" "),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::env::Source;
    use super::*;

    fn placement(hosts: usize, index: usize, local_rank: u32) -> Placement {
        Placement {
            source: Source::Explicit,
            hosts: Hosts::Named((0..hosts).map(|i| format!("h{i}")).collect()),
            host_index: index,
            local_rank,
            local_world_size: 2,
            job_key: "slurm-7.0/x".into(),
        }
    }

    #[test]
    fn voters_are_the_first_three_or_five_hosts() {
        assert_eq!(voters(1), [0]);
        assert_eq!(voters(2), [0, 1]);
        assert_eq!(voters(4), [0, 1, 2]);
        assert_eq!(voters(5), [0, 1, 2, 3, 4]);
        assert_eq!(voters(64), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn the_plan_names_node_paths_and_ports() {
        let plan = Plan::new(
            placement(4, 2, 1),
            Path::new("/shared/pool"),
            Path::new("/tmp"),
            7700,
            1 << 30,
            vec!["python".into(), "train.py".into()],
        );
        assert_eq!(plan.node_id, 3);
        assert_eq!(plan.metrics_port, 7701);
        assert_eq!(plan.run_dir, Path::new("/tmp/spillway-slurm-7.0_x-node3"));
        assert_eq!(
            plan.client_socket(),
            Path::new("/tmp/spillway-slurm-7.0_x-node3/client.sock")
        );
        assert_eq!(
            plan.rendezvous_dir,
            Path::new("/shared/pool/launch/slurm-7.0_x")
        );
        assert!(!plan.starts_node());
        let text = plan.describe();
        assert!(
            text.contains("index 2 (node 3), local rank 1 of 2"),
            "{text}"
        );
        assert!(text.contains("host indices 0,1,2\n"), "{text}");
        assert!(text.contains("python train.py"), "{text}");
        assert!(text.contains("host tier:     1073741824 bytes\n"), "{text}");
    }
}
