//! Unit tests of the node's configuration: defaults, every field's errors, the TOML.
use super::*;

const FILE: &str = "/etc/spillway/node.toml";

fn parse(text: &str) -> Result<NodeConfig, NodeConfigError> {
    NodeConfig::parse(text, Path::new(FILE))
}

const MINIMAL: &str = r#"
node_id = 3
pool_dir = "/pool"
data_dir = "/data"
host_budget = "1GiB"
"#;

/// The error's text names `field` and the file.
fn assert_names(err: &NodeConfigError, field: &str) {
    let text = err.to_string();
    assert!(text.contains(field), "{text:?} does not name {field}");
    assert!(text.contains(FILE), "{text:?} does not name the file");
}

/// Every default the field docs state is the default a minimal file gets (so
/// `spillway node --help` cannot drift from the code).
#[test]
fn field_docs_state_the_real_defaults() {
    let c = parse(MINIMAL).unwrap();
    let doc: toml::Value = toml::Value::try_from(&c).unwrap();
    let mut checked = 0;
    for f in NodeConfig::field_docs() {
        let mut v = Some(&doc);
        for part in f.key.split('.') {
            v = v.and_then(|v| v.get(part));
        }
        let Some(v) = v else { continue };
        let shown = match v {
            toml::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        // Required fields, and defaults stated as a rule ("see ...", a path, a field).
        if !f.default.bytes().all(|b| b.is_ascii_digit()) && !["true", "false"].contains(&f.default)
        {
            continue;
        }
        if matches!(v, toml::Value::Integer(_) | toml::Value::Boolean(_)) {
            assert_eq!(shown, f.default, "the docs of `{}`", f.key);
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} defaults checked");
}

#[test]
fn a_minimal_file_gets_the_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.node_id, NodeId(3));
    assert_eq!(c.listen_addr, "127.0.0.1:7700".parse().unwrap());
    assert_eq!(c.metrics_addr, "127.0.0.1:7701".parse().unwrap());
    assert_eq!(c.page_size, PageSize::default());
    assert_eq!(c.quic, QuicConfig::default());
    assert_eq!(c.host_tier_pages(), 512);
    assert_eq!(c.client_socket, PathBuf::from("/data/spillway.sock"));
    assert_eq!(c.lend_bytes, 1 << 30);
    assert_eq!(
        (
            c.tick_ms,
            c.heartbeat_ticks,
            c.election_ticks,
            c.election_ticks_max
        ),
        (100, 1, 5, 8)
    );
    assert_eq!(c.reserve_chunk_bytes, 64 << 20);
    assert!(c.members.is_empty());
    assert_eq!(
        c.initial_members(),
        vec![MemberAddr {
            id: NodeId(3),
            addr: c.listen_addr
        }]
    );
}

#[test]
fn the_page_transport_parses_and_ucx_needs_the_feature() {
    assert_eq!(parse(MINIMAL).unwrap().transport, PageTransport::Quic);
    let quic = parse(&format!("{MINIMAL}transport = \"quic\"\n")).unwrap();
    assert_eq!(quic.transport, PageTransport::Quic);
    let ucx = parse(&format!("{MINIMAL}transport = \"ucx\"\n"));
    if cfg!(feature = "ucx") {
        assert_eq!(ucx.unwrap().transport, PageTransport::Ucx);
    } else {
        let e = ucx.unwrap_err();
        assert_names(&e, "transport");
        assert!(e.to_string().contains("--features ucx"), "{e}");
    }
    let e = parse(&format!("{MINIMAL}transport = \"rdma\"\n")).unwrap_err();
    assert_names(&e, "transport");
}

#[test]
fn replicas_zone_and_repair_bandwidth_parse_with_their_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(
        (c.replicas, c.zone.as_deref(), c.repair_bytes_per_s),
        (2, None, 256 << 20)
    );
    let c = parse(&format!(
        "{MINIMAL}replicas = 4\nzone = \"rack-7\"\nrepair_bytes_per_s = \"64MiB\"\n"
    ))
    .unwrap();
    assert_eq!(
        (c.replicas, c.zone.as_deref(), c.repair_bytes_per_s),
        (4, Some("rack-7"), 64 << 20)
    );
    assert_eq!(
        parse(&format!("{MINIMAL}replicas = 1\n")).unwrap().replicas,
        1
    );
}

#[test]
fn members_and_raft_timing_parse() {
    let text = format!(
        "{MINIMAL}listen_addr = \"0.0.0.0:7700\"\ntick_ms = 50\nelection_ticks = 10\nelection_ticks_max = 20\nlend_bytes = 4194304\nclient_socket = \"/run/s.sock\"\nmembers = [{{ id = 3, addr = \"10.0.0.3:7700\" }}, {{ id = 4, addr = \"10.0.0.4:7700\" }}]\n"
    );
    let c = parse(&text).unwrap();
    assert_eq!(c.members.len(), 2);
    assert_eq!(c.members[1].addr, "10.0.0.4:7700".parse().unwrap());
    assert_eq!(
        (c.tick_ms, c.election_ticks, c.election_ticks_max),
        (50, 10, 20)
    );
    assert_eq!(c.lend_bytes, 4 << 20);
    assert_eq!(c.client_socket, PathBuf::from("/run/s.sock"));
}

#[test]
fn new_fields_are_named_when_wrong() {
    let m = |s: &str| format!("{MINIMAL}members = [{s}]\n");
    let cases = [
        (m(r#"{ id = 4, addr = "10.0.0.4:7700" }"#), "members"),
        (
            m(r#"{ id = 3, addr = "10.0.0.3:7700" }, { id = 3, addr = "10.0.0.4:7700" }"#),
            "members",
        ),
        (
            m(r#"{ id = 3, addr = "10.0.0.3:7700" }, { id = 4, addr = "10.0.0.3:7700" }"#),
            "members",
        ),
        (m(r#"{ id = 3, addr = "0.0.0.0:7700" }"#), "members"),
        (format!("{MINIMAL}tick_ms = 1\n"), "tick_ms"),
        (format!("{MINIMAL}heartbeat_ticks = 0\n"), "heartbeat_ticks"),
        (format!("{MINIMAL}election_ticks = 1\n"), "election_ticks"),
        (
            format!("{MINIMAL}election_ticks_max = 5\n"),
            "election_ticks_max",
        ),
        (format!("{MINIMAL}lend_bytes = 2147483648\n"), "lend_bytes"),
        (format!("{MINIMAL}lend_bytes = 0\n"), "lend_bytes"),
        (format!("{MINIMAL}lend_bytes = 4096\n"), "lend_bytes"),
        (
            format!("{MINIMAL}reserve_chunk_bytes = 4096\n"),
            "reserve_chunk_bytes",
        ),
        (MINIMAL.replace("node_id = 3", "node_id = 5000"), "node_id"),
        (format!("{MINIMAL}replicas = 0\n"), "replicas"),
        (format!("{MINIMAL}replicas = 5\n"), "replicas"),
        (format!("{MINIMAL}zone = \"\"\n"), "zone"),
        (format!("{MINIMAL}zone = \"{}\"\n", "z".repeat(65)), "zone"),
        (
            format!("{MINIMAL}repair_bytes_per_s = 1000\n"),
            "repair_bytes_per_s",
        ),
        (
            format!(
                "{MINIMAL}listen_addr = \"127.0.0.1:7700\"\nmembers = [{{ id = 3, addr = \"10.0.0.3:7700\" }}]\n"
            ),
            "listen_addr",
        ),
    ];
    for (text, field) in cases {
        let err = parse(&text).unwrap_err();
        assert_eq!(err.field(), Some(field), "{err}");
        assert_names(&err, &format!("`{field}`"));
    }
    let err = parse(&format!("{MINIMAL}members = [{{ id = 3 }}]\n")).unwrap_err();
    assert_names(&err, "addr");
}

#[test]
fn field_docs_cover_every_serialized_field() {
    let c = NodeConfig::new(NodeId(1), "/p".into(), "/d".into(), 1 << 30);
    let value = toml::Value::try_from(&c).unwrap();
    let table = value.as_table().unwrap();
    let docs = NodeConfig::field_docs();
    for (k, v) in table {
        if let Some(sub) = v.as_table() {
            for k2 in sub.keys() {
                let key = format!("{k}.{k2}");
                assert!(docs.iter().any(|d| d.key == key), "{key} has no doc");
            }
        } else {
            assert!(docs.iter().any(|d| d.key == k), "{k} has no doc");
        }
    }
    assert!(
        docs.iter()
            .all(|d| !d.doc.is_empty() && !d.default.is_empty())
    );
}

#[test]
fn a_full_file_round_trips() {
    let mut c = NodeConfig::new(NodeId(7), "/p".into(), "/d".into(), 64 << 20);
    c.page_size = PageSize::new(64 << 10).unwrap();
    c.quic.connections_per_peer = 2;
    c.listen_addr = "10.0.0.7:7800".parse().unwrap();
    c.replicas = 3;
    c.zone = Some("rack-2".into());
    let text = toml::to_string(&c).unwrap();
    assert_eq!(parse(&text).unwrap(), c);
}

#[test]
fn unknown_wrong_and_missing_fields_are_named() {
    let budget = "host_budget = \"1GiB\"";
    // (what, the file, the name its error gives, whether it must be a TOML parse error)
    let cases = [
        (
            "an unknown field",
            format!("{MINIMAL}host_tier_gib = 4\n"),
            "host_tier_gib",
            true,
        ),
        (
            "an unknown quic field",
            format!("{MINIMAL}[quic]\nmtu = 9000\n"),
            "mtu",
            false,
        ),
        (
            "a wrong type",
            MINIMAL.replace(budget, "host_budget = true"),
            "host_budget",
            true,
        ),
        (
            "a missing required field",
            MINIMAL.replace(budget, ""),
            "host_budget",
            false,
        ),
        (
            "a bad page size",
            format!("{MINIMAL}page_size = 1000\n"),
            "page_size",
            false,
        ),
    ];
    for (what, text, name, parse_error) in cases {
        let err = parse(&text).unwrap_err();
        if parse_error {
            assert!(
                matches!(err, NodeConfigError::Parse { .. }),
                "{what}: {err}"
            );
        }
        assert_names(&err, name);
    }
}

#[test]
fn range_errors_name_the_field() {
    let h = "host_budget = \"1GiB\"";
    let cases = [
        (h, "host_budget = 4096", "host_budget"),
        ("node_id = 3", "node_id = 0", "node_id"),
        (
            h,
            "host_budget = \"1GiB\"\n[quic]\nloopback_mtu_bytes = 9000",
            "quic.loopback_mtu_bytes",
        ),
        (
            h,
            "host_budget = \"1GiB\"\nmetrics_addr = \"127.0.0.1:7700\"",
            "metrics_addr",
        ),
    ];
    for (from, to, field) in cases {
        let err = parse(&MINIMAL.replace(from, to)).unwrap_err();
        assert_eq!(err.field(), Some(field), "{err}");
        assert_names(&err, &format!("`{field}`"));
    }
}

#[test]
fn a_missing_file_is_named() {
    let path = Path::new("/nonexistent/spillway/node.toml");
    let err = NodeConfig::load(path).unwrap_err();
    assert!(matches!(err, NodeConfigError::Read { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/spillway/node.toml"));
}
