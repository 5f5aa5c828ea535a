//! Join tokens and where they are recorded.
//!
//! A token is `spw1.<id>.<secret>.<ca-sha256>`: a 64-bit id (16 hex digits), a 128-bit
//! secret (32 hex digits) and the SHA-256 of the pool's CA certificate (64 hex digits,
//! [`crate::certs::ca_fingerprint`]). Whoever holds it can join the pool once, before it
//! expires, and checks that the bootstrap endpoint it reaches holds the pool's CA.
//!
//! Tokens are recorded in the CA's directory (the operator's, with `ca.key.pem`), one file
//! per token in `join-tokens/<id>`: the secret's SHA-256 (never the secret) and when it
//! expires, in Unix milliseconds. Only a host holding that directory can make or accept
//! tokens: the bootstrap endpoint runs on the node whose `ca_dir` names it. A token is
//! used up by renaming its file to `<id>.used` after its secret and expiry were checked:
//! the rename is atomic, so of two joins racing with one token exactly one wins.
//! Simpler than the replicated state (no CA key on other nodes, no Raft entry), at the
//! cost that only that host serves joins.

use std::fmt;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use super::JoinRefusal;
use crate::certs::sha256;

/// The token format's prefix (its version).
pub const TOKEN_PREFIX: &str = "spw1";
/// Largest token file read: 4 KiB (a file is ~120 bytes).
pub const TOKEN_FILE_BYTES_MAX: u64 = 4096;
/// Longest lifetime a token may have: 30 days.
pub const TOKEN_TTL_MAX: Duration = Duration::from_secs(30 * 24 * 3600);
/// The folder of the CA's directory that holds the tokens.
pub const TOKENS_DIR: &str = "join-tokens";

/// A join token (see the module docs).
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    /// Names the token's record.
    pub id: u64,
    /// Proves the holder was given the token.
    pub secret: [u8; 16],
    /// SHA-256 of the pool's CA certificate (DER).
    pub ca_sha256: [u8; 32],
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        f.debug_struct("JoinToken")
            .field("id", &format_args!("{:016x}", self.id))
            .field("ca_sha256", &hex(&self.ca_sha256))
            .finish_non_exhaustive()
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{TOKEN_PREFIX}.{:016x}.{}.{}",
            self.id,
            hex(&self.secret),
            hex(&self.ca_sha256)
        )
    }
}

/// Why a token could not be read, made or recorded.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The text is not a token.
    #[error("not a join token (spw1.<16 hex>.<32 hex>.<64 hex>): {reason}")]
    Malformed {
        /// What is wrong.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A token file does not hold a token record.
    #[error("{}: {problem}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The lifetime asked for is 0 or longer than [`TOKEN_TTL_MAX`].
    #[error("a token lives from 1 s to {} days, not {ttl_s} s", TOKEN_TTL_MAX.as_secs() / 86400)]
    Ttl {
        /// The lifetime asked for.
        ttl_s: u64,
    },
}

impl FromStr for JoinToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<JoinToken, TokenError> {
        let bad = |reason: &str| TokenError::Malformed {
            reason: reason.to_string(),
        };
        let mut parts = s.trim().split('.');
        if parts.next() != Some(TOKEN_PREFIX) {
            return Err(bad("it does not start with spw1."));
        }
        let (Some(id), Some(secret), Some(fp), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("it has not four dot-separated parts"));
        };
        let id: [u8; 8] = unhex(id).ok_or_else(|| bad("the id is not 16 hex digits"))?;
        Ok(JoinToken {
            id: u64::from_be_bytes(id),
            secret: unhex(secret).ok_or_else(|| bad("the secret is not 32 hex digits"))?,
            ca_sha256: unhex(fp)
                .ok_or_else(|| bad("the CA fingerprint is not 64 hex digits (SHA-256)"))?,
        })
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exactly `N` bytes from `2N` hex digits.
fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Equality of two digests in time independent of where they differ.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The tokens of one CA directory (see the module docs).
#[derive(Clone, Debug)]
pub struct TokenStore {
    dir: PathBuf,
}

/// One token's record.
struct Record {
    secret_sha256: [u8; 32],
    expires_at_ms: u64,
}

impl TokenStore {
    /// The tokens of the CA directory `ca_dir` (in `ca_dir/join-tokens`).
    pub fn in_ca_dir(ca_dir: &Path) -> TokenStore {
        TokenStore {
            dir: ca_dir.join(TOKENS_DIR),
        }
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}"))
    }

    fn used_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}.used"))
    }

    /// Makes a token for the CA whose fingerprint is `ca_sha256`, valid for `ttl` from
    /// `now_ms` (Unix milliseconds), and records it (mode 0600). Returns it and when it
    /// expires.
    pub fn create(
        &self,
        ca_sha256: [u8; 32],
        ttl: Duration,
        now_ms: u64,
    ) -> Result<(JoinToken, u64), TokenError> {
        if ttl.is_zero() || ttl > TOKEN_TTL_MAX {
            return Err(TokenError::Ttl {
                ttl_s: ttl.as_secs(),
            });
        }
        let rng = ring::rand::SystemRandom::new();
        let mut bytes = [0u8; 24];
        ring::rand::SecureRandom::fill(&rng, &mut bytes).map_err(|_| TokenError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other("the system's random source failed"),
        })?;
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[..8]);
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&bytes[8..]);
        let token = JoinToken {
            id: u64::from_be_bytes(id),
            secret,
            ca_sha256,
        };
        let expires_at_ms = now_ms.saturating_add(ttl.as_millis() as u64);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TokenError::Io { path, source }
        };
        fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let path = self.path(token.id);
        let mut options = fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&path).map_err(io(&path))?;
        let text = format!(
            "spillway-join-token 1\nsecret_sha256 {}\nexpires_at_ms {expires_at_ms}\n",
            hex(&sha256(&token.secret))
        );
        file.write_all(text.as_bytes()).map_err(io(&path))?;
        file.sync_all().map_err(io(&path))?;
        Ok((token, expires_at_ms))
    }

    fn read(&self, path: &Path) -> Result<Record, TokenError> {
        let corrupt = |problem: &str| TokenError::Corrupt {
            path: path.to_path_buf(),
            problem: problem.to_string(),
        };
        let meta = fs::metadata(path).map_err(|source| TokenError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if meta.len() > TOKEN_FILE_BYTES_MAX {
            return Err(corrupt("larger than a token record"));
        }
        let text = fs::read_to_string(path).map_err(|source| TokenError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut lines = text.lines();
        if lines.next() != Some("spillway-join-token 1") {
            return Err(corrupt("not a token record (version 1)"));
        }
        let secret_sha256 = lines
            .next()
            .and_then(|l| l.strip_prefix("secret_sha256 "))
            .and_then(unhex)
            .ok_or_else(|| corrupt("no secret_sha256"))?;
        let expires_at_ms = lines
            .next()
            .and_then(|l| l.strip_prefix("expires_at_ms "))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| corrupt("no expires_at_ms"))?;
        Ok(Record {
            secret_sha256,
            expires_at_ms,
        })
    }

    /// Whether token `id` with `secret` may join now (`now_ms`), without using it up.
    pub fn check(&self, id: u64, secret: &[u8; 16], now_ms: u64) -> Result<(), JoinRefusal> {
        let path = self.path(id);
        let record = match self.read(&path) {
            Ok(r) => r,
            Err(TokenError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Err(if self.used_path(id).exists() {
                    JoinRefusal::TokenUsed
                } else {
                    JoinRefusal::UnknownToken
                });
            }
            Err(e) => {
                return Err(JoinRefusal::Internal {
                    reason: e.to_string(),
                });
            }
        };
        if !same_digest(&record.secret_sha256, &sha256(secret)) {
            return Err(JoinRefusal::WrongSecret);
        }
        if now_ms >= record.expires_at_ms {
            return Err(JoinRefusal::TokenExpired {
                expired_at_ms: record.expires_at_ms,
            });
        }
        Ok(())
    }

    /// Checks token `id` as [`TokenStore::check`] does and uses it up: afterwards every
    /// use is refused with [`JoinRefusal::TokenUsed`]. Of two racing calls, one wins.
    pub fn consume(&self, id: u64, secret: &[u8; 16], now_ms: u64) -> Result<(), JoinRefusal> {
        self.check(id, secret, now_ms)?;
        match fs::rename(self.path(id), self.used_path(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(JoinRefusal::TokenUsed),
            Err(e) => Err(JoinRefusal::Internal {
                reason: format!("cannot use up the token: {e}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        crate::test_dirs::temp_dir("token", name)
    }

    #[test]
    fn a_token_prints_and_parses_back_and_junk_is_a_typed_error() {
        let t = JoinToken {
            id: 0x0123_4567_89ab_cdef,
            secret: [0xa5; 16],
            ca_sha256: [7; 32],
        };
        let text = t.to_string();
        assert_eq!(text.len(), 4 + 1 + 16 + 1 + 32 + 1 + 64);
        assert!(text.starts_with("spw1.0123456789abcdef.a5a5"), "{text}");
        assert_eq!(text.parse::<JoinToken>().unwrap(), t);
        assert!(!format!("{t:?}").contains("a5a5"), "Debug shows the secret");
        for junk in [
            "",
            "spw1",
            "spw2.0123456789abcdef.a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5.00",
            &text[..text.len() - 1],
            &format!("{text}.00"),
            &text.replace("0123456789abcdef", "0123456789abcdeg"),
            "spw1.é123456789abcde.a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5.x",
        ] {
            assert!(
                matches!(junk.parse::<JoinToken>(), Err(TokenError::Malformed { .. })),
                "{junk:?}"
            );
        }
    }

    #[test]
    fn a_token_joins_once_before_it_expires() {
        let dir = temp_dir("store");
        let store = TokenStore::in_ca_dir(&dir);
        let (t, expires) = store
            .create([1; 32], Duration::from_secs(60), 1_000)
            .unwrap();
        assert_eq!(expires, 61_000);
        assert_eq!(t.ca_sha256, [1; 32]);
        let mut wrong = t.secret;
        wrong[0] ^= 1;
        assert_eq!(
            store.consume(t.id, &wrong, 2_000),
            Err(JoinRefusal::WrongSecret)
        );
        assert_eq!(
            store.check(t.id, &t.secret, 61_000),
            Err(JoinRefusal::TokenExpired {
                expired_at_ms: 61_000
            })
        );
        assert_eq!(
            store.check(t.id ^ 1, &t.secret, 2_000),
            Err(JoinRefusal::UnknownToken)
        );
        store.consume(t.id, &t.secret, 2_000).unwrap();
        assert_eq!(
            store.consume(t.id, &t.secret, 2_000),
            Err(JoinRefusal::TokenUsed)
        );
        assert!(matches!(
            store.create([1; 32], Duration::ZERO, 0),
            Err(TokenError::Ttl { ttl_s: 0 })
        ));
        // A corrupt record is refused, not trusted.
        let (t2, _) = store.create([1; 32], Duration::from_secs(1), 0).unwrap();
        fs::write(dir.join(TOKENS_DIR).join(format!("{:016x}", t2.id)), "junk").unwrap();
        assert!(matches!(
            store.check(t2.id, &t2.secret, 0),
            Err(JoinRefusal::Internal { .. })
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
