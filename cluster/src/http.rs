//! A minimal HTTP/1.1 GET over a std `TcpStream`, enough to read a node's `/status`.
//!
//! Bounded in time and memory: the connect, each read and the whole exchange share one
//! deadline, and a response larger than [`RESPONSE_BYTES_MAX`] is refused. Understands a
//! body delimited by `Content-Length`, by chunked transfer coding or by the end of the
//! connection (the request says `Connection: close`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest response read, headers and body: 1 MiB (a status of 64 members is ~10 KiB).
pub const RESPONSE_BYTES_MAX: usize = 1 << 20;
/// Largest header block: 16 KiB.
const HEADER_BYTES_MAX: usize = 16 << 10;

/// Why a GET failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address does not resolve.
    #[error("cannot resolve {target}: {reason}")]
    Resolve {
        /// host:port as given.
        target: String,
        /// Why.
        reason: String,
    },
    /// No connection (refused, unreachable).
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The deadline passed.
    #[error("no complete answer from {addr} within {timeout:?}")]
    Timeout {
        /// The address.
        addr: SocketAddr,
        /// The deadline.
        timeout: Duration,
    },
    /// The connection failed midway.
    #[error("{addr}: {source}")]
    Io {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The response is larger than [`RESPONSE_BYTES_MAX`].
    #[error("{addr} sent more than {limit_bytes} bytes")]
    TooLarge {
        /// The address.
        addr: SocketAddr,
        /// The limit.
        limit_bytes: usize,
    },
    /// The response is not HTTP as we understand it.
    #[error("{addr} sent a malformed response: {problem}")]
    Malformed {
        /// The address.
        addr: SocketAddr,
        /// What is wrong.
        problem: String,
    },
}

/// A response: status code and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

/// Resolves `host:port` to its first address.
pub fn resolve(target: &str) -> Result<SocketAddr, HttpError> {
    let resolve_err = |reason: String| HttpError::Resolve {
        target: target.to_string(),
        reason,
    };
    target
        .to_socket_addrs()
        .map_err(|e| resolve_err(e.to_string()))?
        .next()
        .ok_or_else(|| resolve_err("no address".to_string()))
}

/// GETs `path` from `addr`, all within `timeout`.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Response, HttpError> {
    let deadline = Instant::now() + timeout;
    let timed_out = || HttpError::Timeout { addr, timeout };
    let io = |source: std::io::Error| match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => timed_out(),
        _ => HttpError::Io { addr, source },
    };
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|source| {
        if source.kind() == std::io::ErrorKind::TimedOut {
            timed_out()
        } else {
            HttpError::Connect { addr, source }
        }
    })?;
    let left = |deadline: Instant| {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    };
    stream
        .set_write_timeout(Some(left(deadline).ok_or_else(timed_out)?))
        .map_err(io)?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\nConnection: close\r\nUser-Agent: spillway\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(io)?;

    let mut buf = Vec::with_capacity(16 << 10);
    let mut chunk = [0u8; 16 << 10];
    loop {
        if let Some(response) =
            parse(&buf, false).map_err(|problem| HttpError::Malformed { addr, problem })?
        {
            return Ok(response);
        }
        stream
            .set_read_timeout(Some(left(deadline).ok_or_else(timed_out)?))
            .map_err(io)?;
        let n = stream.read(&mut chunk).map_err(io)?;
        if n == 0 {
            return parse(&buf, true)
                .map_err(|problem| HttpError::Malformed { addr, problem })?
                .ok_or_else(|| HttpError::Malformed {
                    addr,
                    problem: "connection closed before the response was complete".to_string(),
                });
        }
        if buf.len() + n > RESPONSE_BYTES_MAX {
            return Err(HttpError::TooLarge {
                addr,
                limit_bytes: RESPONSE_BYTES_MAX,
            });
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The response in `buf` if it is complete (`eof`: the peer closed the connection).
fn parse(buf: &[u8], eof: bool) -> Result<Option<Response>, String> {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        if buf.len() > HEADER_BYTES_MAX {
            return Err(format!("headers longer than {HEADER_BYTES_MAX} bytes"));
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "headers are not UTF-8")?;
    let body = &buf[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(format!("status line {status_line:?}"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("status line {status_line:?}"))?;
    let (mut length, mut chunked) = (None, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("header line {line:?}"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse::<usize>()
                    .map_err(|_| format!("Content-Length {value:?}"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
    }
    if chunked {
        return Ok(dechunk(body)?.map(|body| Response { status, body }));
    }
    match length {
        Some(len) if body.len() >= len => Ok(Some(Response {
            status,
            body: body[..len].to_vec(),
        })),
        Some(_) if eof => Err("connection closed before Content-Length bytes".to_string()),
        Some(_) => Ok(None),
        None if eof => Ok(Some(Response {
            status,
            body: body.to_vec(),
        })),
        None => Ok(None),
    }
}

/// The body of a chunked response if its last chunk has arrived.
fn dechunk(mut rest: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let mut body = Vec::new();
    loop {
        let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size_text = std::str::from_utf8(&rest[..line_end]).map_err(|_| "chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(Some(body));
        }
        if rest.len() < size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_by_length_chunks_and_eof() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", false)
            .unwrap()
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}", false).unwrap(),
            None
        );
        let chunked = b"HTTP/1.1 404 Not Found\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        let r = parse(chunked, false).unwrap().unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"abcde"[..]));
        assert_eq!(parse(&chunked[..chunked.len() - 7], false).unwrap(), None);
        let r = parse(b"HTTP/1.0 200 OK\r\n\r\nuntil eof", true)
            .unwrap()
            .unwrap();
        assert_eq!(r.body, b"until eof");
        assert_eq!(parse(b"HTTP/1.0 200 OK\r\n\r\nmore", false).unwrap(), None);
    }

    #[test]
    fn garbage_is_malformed() {
        assert!(parse(b"SSH-2.0-OpenSSH\r\n\r\n", false).is_err());
        assert!(parse(b"HTTP/1.1 abc\r\n\r\n", false).is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", false).is_err());
        assert!(parse(&vec![b'a'; HEADER_BYTES_MAX + 1], false).is_err());
    }
}
