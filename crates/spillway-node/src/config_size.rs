//! Sizes in a node config: a TOML integer of bytes or a string the one size parser reads
//! ([`spillway_types::size`]: `"64GiB"`, `"512 MiB"`, `"1073741824"`), for `host_budget`,
//! `lend_bytes` and `reserve_chunk_bytes`; and the note for the old key `host_tier_bytes`,
//! still read (as `host_budget`) for one release.

use serde::{Deserialize, Deserializer};

/// The key of the host tier's budget, in the flags' vocabulary (`--host-budget`).
pub(crate) const HOST_BUDGET_KEY: &str = "host_budget";
/// Its old name, read with a note for one release.
pub(crate) const HOST_BUDGET_OLD_KEY: &str = "host_tier_bytes";

/// A size as a TOML integer (bytes, not negative) or a string of the size parser.
pub(crate) fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d).map_err(|_| {
        serde::de::Error::custom(
            "expected a size: a number of bytes (not negative) or a string such as \"64GiB\"",
        )
    })? {
        Size::Bytes(b) => Ok(b),
        Size::Text(t) => spillway_types::size::parse_size(&t).map_err(serde::de::Error::custom),
    }
}

/// The note for a file that still says `host_tier_bytes`, or `None`.
pub(crate) fn old_key_note(text: &str, origin: &std::path::Path) -> Option<String> {
    let table: toml::Table = toml::from_str(text).ok()?;
    table.contains_key(HOST_BUDGET_OLD_KEY).then(|| {
        format!(
            "note: {}: `{HOST_BUDGET_OLD_KEY}` is deprecated and will be removed in the next \
             release; write `{HOST_BUDGET_KEY}` (a size, e.g. {HOST_BUDGET_KEY} = \"64GiB\")",
            origin.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{NodeConfig, NodeConfigError};

    const BASE: &str = "node_id = 3\npool_dir = \"/pool\"\ndata_dir = \"/data\"\n";

    fn parse(extra: &str) -> Result<NodeConfig, NodeConfigError> {
        NodeConfig::parse(&format!("{BASE}{extra}"), Path::new("/etc/node.toml"))
    }

    #[test]
    fn sizes_are_read_as_strings_or_integers_by_the_one_parser() {
        let c = parse(
            "host_budget = \"1GiB\"\nlend_bytes = \"512 MiB\"\nreserve_chunk_bytes = \"32MiB\"\n",
        )
        .unwrap();
        assert_eq!(c.host_tier_bytes, 1 << 30);
        assert_eq!(c.lend_bytes, 512 << 20);
        assert_eq!(c.reserve_chunk_bytes, 32 << 20);
        assert_eq!(
            parse("host_budget = 1073741824\n").unwrap().host_tier_bytes,
            1 << 30
        );
        let err = parse("host_budget = \"1 GB of RAM\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("host_budget") && err.contains("not a unit"),
            "{err}"
        );
        let err = parse("host_budget = -1\n").unwrap_err().to_string();
        assert!(
            err.contains("host_budget") && err.contains("expected a size"),
            "{err}"
        );
    }

    #[test]
    fn the_old_key_is_read_with_a_note_and_never_beside_the_new_one() {
        let old = format!("{BASE}host_tier_bytes = 1073741824\n");
        let c = NodeConfig::parse(&old, Path::new("/etc/node.toml")).unwrap();
        assert_eq!(c.host_tier_bytes, 1 << 30);
        assert_eq!(
            super::old_key_note(&old, Path::new("/etc/node.toml")).unwrap(),
            "note: /etc/node.toml: `host_tier_bytes` is deprecated and will be removed in the \
             next release; write `host_budget` (a size, e.g. host_budget = \"64GiB\")"
        );
        assert_eq!(
            super::old_key_note(&format!("{BASE}host_budget = \"1GiB\"\n"), Path::new("x")),
            None
        );
        let err = parse("host_budget = \"1GiB\"\nhost_tier_bytes = 1073741824\n").unwrap_err();
        assert!(matches!(err, NodeConfigError::Parse { .. }), "{err}");
        // A written config says host_budget.
        let text = toml::to_string(&NodeConfig::new(
            spillway_types::NodeId(1),
            "/p".into(),
            "/d".into(),
            1 << 30,
        ))
        .unwrap();
        assert!(text.contains("host_budget = 1073741824"), "{text}");
        assert!(!text.contains("host_tier_bytes"), "{text}");
    }
}
