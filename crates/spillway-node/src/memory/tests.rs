use std::path::PathBuf;

use spillway_types::NodeId;

use super::*;
use crate::config::MemberAddr;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A fixture tree under `testdata/cgroup/` (a fake `/`: `proc/self/cgroup` and
/// `sys/fs/cgroup/...`).
fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/cgroup")
        .join(name)
}

fn config(host_budget: u64, peers: u64) -> NodeConfig {
    let mut c = NodeConfig::new(
        NodeId(1),
        PathBuf::from("/pool"),
        PathBuf::from("/data"),
        host_budget,
    );
    c.members = (1..=peers + 1)
        .map(|id| MemberAddr {
            id: NodeId(id),
            addr: format!("10.0.0.{id}:7700").parse().unwrap(),
        })
        .collect();
    c
}

#[test]
fn proc_cgroup_lines_name_the_memory_hierarchy() {
    assert_eq!(
        parse_proc_cgroup("0::/job.slice/step_0\n"),
        Some((CgroupVersion::V2, "/job.slice/step_0".to_string()))
    );
    // Hybrid: the v1 memory controller is the one enforced.
    let hybrid = "12:cpu,cpuacct:/a\n11:memory:/slurm/job_7\n0::/user.slice\n";
    assert_eq!(
        parse_proc_cgroup(hybrid),
        Some((CgroupVersion::V1, "/slurm/job_7".to_string()))
    );
    // A v1 machine without the memory controller mounted, and junk lines: no limit.
    assert_eq!(parse_proc_cgroup("4:cpu:/x\n"), None);
    assert_eq!(parse_proc_cgroup("garbage\n:\nx::/\n0::relative\n"), None);
    assert_eq!(parse_proc_cgroup(""), None);
}

#[test]
fn limit_files_parse() {
    assert_eq!(parse_limit("max\n"), None);
    assert_eq!(parse_limit("9223372036854771712\n"), None);
    assert_eq!(parse_limit("8589934592\n"), Some(8 * GIB));
    assert_eq!(parse_limit(" 4096 "), Some(4096));
    assert_eq!(parse_limit("-1"), None);
    assert_eq!(parse_limit(""), None);
}

/// Checks the cgroup limit read under fixture `name`: `limit_bytes`, from the file
/// whose path ends with `file`.
fn assert_cgroup_limit(name: &str, limit_bytes: u64, file: &str) {
    let c = MemoryLimits::read_under(&fixture(name), None)
        .cgroup
        .unwrap();
    assert_eq!(c.limit_bytes, limit_bytes);
    assert!(c.file.ends_with(file), "{}", c.file.display());
}

#[test]
fn v2_takes_the_lowest_limit_of_the_cgroup_and_its_ancestors() {
    assert_cgroup_limit(
        "v2-nested",
        4 * GIB,
        "sys/fs/cgroup/job.slice/step_0/memory.max",
    );
}

#[test]
fn v1_memory_controller_is_read_on_a_hybrid_machine() {
    assert_cgroup_limit(
        "v1-hybrid",
        2 * GIB,
        "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.limit_in_bytes",
    );
}

#[test]
fn a_namespaced_cgroup_reads_the_mount_top() {
    let c = MemoryLimits::read_under(&fixture("v2-namespace"), None)
        .cgroup
        .unwrap();
    assert_eq!(c.limit_bytes, GIB);
}

#[test]
fn max_everywhere_and_missing_files_are_no_limit() {
    assert_eq!(
        MemoryLimits::read_under(&fixture("v2-unlimited"), Some(64 * MIB)),
        MemoryLimits {
            cgroup: None,
            memlock_bytes: Some(64 * MIB)
        }
    );
    assert_eq!(
        MemoryLimits::read_under(&fixture("no-such-fixture"), None),
        MemoryLimits::unlimited()
    );
}

#[test]
fn the_plan_counts_the_budget_the_base_and_the_buffers_in_flight() {
    let plan = MemoryPlan::of(&config(GIB, 2), None);
    assert_eq!(
        plan,
        MemoryPlan {
            host_budget_bytes: GIB,
            base_overhead_bytes: 32 * MIB,
            peer_receive_bytes: 2 * 64 * MIB,
            client_copy_bytes: 64 * 2 * MIB,
            pinned_bytes: 0,
        }
    );
    assert_eq!(plan.overhead_bytes(), (32 + 128 + 128) * MIB);
    // 1 GiB x 1.05, rounded up, plus the overhead.
    let slack = (GIB as f64 * 1.05).ceil() as u64;
    assert_eq!(plan.resident_max_bytes(), slack + 288 * MIB);
    // The largest budget that fits a limit is the inverse.
    let fits = plan.host_budget_max_bytes(plan.resident_max_bytes());
    assert!(fits.abs_diff(GIB) <= 1, "{fits}");
    assert_eq!(plan.host_budget_max_bytes(100 * MIB), 0);
}

#[test]
fn a_node_alone_plans_no_peer_buffers() {
    let mut c = config(GIB, 0);
    c.members.clear();
    assert_eq!(MemoryPlan::of(&c, None).peer_receive_bytes, 0);
}

#[test]
fn ucx_pins_the_host_budget_unless_kept_off_rdma() {
    let mut c = config(GIB, 2);
    c.transport = PageTransport::Ucx;
    assert_eq!(MemoryPlan::of(&c, None).pinned_bytes, GIB);
    assert_eq!(MemoryPlan::of(&c, Some("rc,sm")).pinned_bytes, GIB);
    assert_eq!(MemoryPlan::of(&c, Some("rc_x")).pinned_bytes, GIB);
    assert_eq!(MemoryPlan::of(&c, Some("^tcp")).pinned_bytes, GIB);
    assert_eq!(MemoryPlan::of(&c, Some("tcp,self")).pinned_bytes, 0);
    assert_eq!(MemoryPlan::of(&c, Some("sm,self,tcp")).pinned_bytes, 0);
}

#[test]
fn a_plan_above_the_cgroup_limit_is_refused_with_the_numbers() {
    let plan = MemoryPlan::of(&config(GIB, 2), None);
    let limits = MemoryLimits::read_under(&fixture("v2-namespace"), None);
    let err = check(&plan, &limits).unwrap_err();
    let MemoryError::OverCgroupLimit {
        needed_bytes,
        limit_bytes,
        ref file,
        ..
    } = err
    else {
        panic!("{err:?}")
    };
    assert_eq!(needed_bytes, plan.resident_max_bytes());
    assert_eq!(limit_bytes, GIB);
    assert!(file.ends_with("sys/fs/cgroup/memory.max"));
    let text = err.to_string();
    let max = plan.host_budget_max_bytes(GIB);
    assert!(text.contains(&size(max)), "{text}");
    assert!(text.contains("1.0 GiB (1073741824 bytes)"), "{text}");
    assert!(text.contains("lower host_budget"), "{text}");
    // The largest budget it names fits.
    let smaller = MemoryPlan::of(&config(max, 2), None);
    assert_eq!(check(&smaller, &limits), Ok(()));
    // Without a limit, anything goes.
    assert_eq!(check(&plan, &MemoryLimits::unlimited()), Ok(()));
}

#[test]
fn pinned_memory_above_memlock_is_refused() {
    let mut c = config(GIB, 2);
    c.transport = PageTransport::Ucx;
    let plan = MemoryPlan::of(&c, None);
    let tight = MemoryLimits {
        cgroup: None,
        memlock_bytes: Some(8 * MIB),
    };
    let err = check(&plan, &tight).unwrap_err();
    assert_eq!(
        err,
        MemoryError::OverMemlock {
            pinned_bytes: GIB,
            memlock_bytes: 8 * MIB
        }
    );
    assert!(err.to_string().contains("ulimit -l"), "{err}");
    // Unlimited memlock, or QUIC (nothing pinned), passes.
    let open = MemoryLimits {
        cgroup: None,
        memlock_bytes: None,
    };
    assert_eq!(check(&plan, &open), Ok(()));
    let quic = MemoryPlan::of(&config(GIB, 2), None);
    assert_eq!(check(&quic, &tight), Ok(()));
}

#[test]
fn clients_get_the_room_the_cgroup_leaves_after_the_plan() {
    let plan = MemoryPlan::of(&config(512 * MIB, 2), None);
    let limits = MemoryLimits::read_under(&fixture("v2-namespace"), None);
    assert_eq!(
        client_room_bytes(&plan, &limits),
        Some(GIB - plan.resident_max_bytes())
    );
    assert_eq!(client_room_bytes(&plan, &MemoryLimits::unlimited()), None);
}

#[test]
fn the_allocator_setting_is_accepted() {
    // Process-wide and harmless to the other tests: pages are still allocated and freed.
    return_page_buffers_to_the_os(2 * MIB);
    let v = vec![1u8; 4 * MIB as usize];
    assert_eq!(v.iter().map(|&b| u64::from(b)).sum::<u64>(), 4 * MIB);
}

#[test]
fn the_host_budget_is_taken_and_given_back_whole() {
    let b = HostBudget::new(10);
    assert_eq!(b.try_take(6), Ok(()));
    assert_eq!(b.try_take(5), Err(6));
    assert_eq!(b.try_take(4), Ok(()));
    assert_eq!(b.used_bytes(), 10);
    b.give_back(6);
    assert_eq!(b.try_take(u64::MAX), Err(4));
    assert_eq!((b.used_bytes(), b.budget_bytes()), (4, 10));
}

#[test]
fn sizes_read_for_people() {
    assert_eq!(size(3 << 29), "1.5 GiB (1610612736 bytes)");
    assert_eq!(size(512), "512 bytes");
    assert_eq!(size(32 * MIB), "32.0 MiB (33554432 bytes)");
}
