use super::*;

fn parse(text: &str) -> Result<Trace, TraceError> {
    parse_trace(text.as_bytes())
}

fn parse_err(text: &str) -> TraceError {
    match parse(text) {
        Ok(trace) => panic!("expected an error, parsed {trace:?}"),
        Err(e) => {
            // Every error must also display without panicking.
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

const VALID: &str = concat!(
    r#"{"step": 0, "buffer": "embed", "bytes": 4096, "phase": "fwd", "compute_us": 12.5}"#,
    "\n",
    r#"{"step": 0, "buffer": "layers.0.attn", "bytes": 8192, "phase": "fwd"}"#,
    "\n\n   \n",
    r#"{"step": 0, "buffer": "layers.0.attn", "bytes": 8192, "phase": "bwd", "compute_us": 3}"#,
    "\r\n",
    r#"{"step": 0, "buffer": "", "bytes": 0, "phase": "step", "compute_us": 1.5, "_note": [1, {"x": 2}]}"#,
    "\n",
    r#"{"step": 2, "buffer": "embed", "bytes": 4096, "phase": "fwd", "compute_us": null}"#,
    "\n",
    r#"{"step": 2, "buffer": "", "bytes": 0, "phase": "step"}"#,
);

#[test]
fn valid_trace_is_parsed() {
    let trace = parse(VALID).unwrap();
    assert_eq!(trace.accesses.len(), 4);
    assert_eq!(trace.markers_skipped, 2);
    assert_eq!(
        trace.buffers,
        vec![
            ("embed".to_owned(), 4096),
            ("layers.0.attn".to_owned(), 8192)
        ]
    );
    assert_eq!(trace.steps, vec![0, 2]);
    assert_eq!(trace.buffer_bytes_total(), 4096 + 8192);
    assert_eq!(trace.accesses[0].compute_us, Some(12.5));
    assert_eq!(trace.accesses[1].compute_us, None);
    // The marker's 1.5 us is added to the access before it.
    assert_eq!(trace.accesses[2].compute_us, Some(4.5));
    assert_eq!(trace.accesses[2].phase, "bwd");
    assert_eq!(trace.accesses[3].compute_us, None);

    assert_eq!(trace.step_accesses(0).len(), 3);
    assert_eq!(trace.step_accesses(1).len(), 0);
    assert_eq!(trace.step_accesses(2).len(), 1);
    assert_eq!(trace.step_accesses(3).len(), 0);
    let by_step: Vec<(u64, usize)> = trace
        .accesses_by_step()
        .map(|(step, accesses)| (step, accesses.len()))
        .collect();
    assert_eq!(by_step, vec![(0, 3), (2, 1)]);
}

#[test]
fn last_line_without_newline_and_line_at_the_limit_are_read() {
    let line = r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd"}"#;
    let limits = Limits {
        line_bytes_max: line.len(),
        ..Limits::DEFAULT
    };
    let text = format!("{line}\n{line}");
    let trace = parse_with_limits(text.as_bytes(), limits).unwrap();
    assert_eq!(trace.accesses.len(), 2);
}

#[test]
fn bad_json_names_the_line() {
    let e = parse_err(
        "{\"step\": 0, \"buffer\": \"a\", \"bytes\": 1, \"phase\": \"fwd\"}\n{\"step\": 0,",
    );
    assert!(matches!(e, TraceError::BadJson { line: 2, .. }), "{e}");
    assert!(!e.to_string().contains("at line 1"), "{e}");
    // Not an object.
    let e = parse_err("[1, 2]");
    assert!(matches!(e, TraceError::BadJson { line: 1, .. }), "{e}");
    // Trailing garbage.
    let e = parse_err(r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd"} x"#);
    assert!(matches!(e, TraceError::BadJson { line: 1, .. }), "{e}");
    // NaN is not JSON (Python's json.dumps writes it unless allow_nan=False).
    let e =
        parse_err(r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd", "compute_us": NaN}"#);
    assert!(matches!(e, TraceError::BadJson { line: 1, .. }), "{e}");
    // Invalid UTF-8.
    let e =
        parse_trace(&b"{\"step\": 0, \"buffer\": \"\xff\", \"bytes\": 1, \"phase\": \"f\"}"[..])
            .unwrap_err();
    assert!(matches!(e, TraceError::BadJson { line: 1, .. }), "{e}");
}

#[test]
fn missing_field() {
    let e = parse_err("\n{\"step\": 0, \"buffer\": \"a\", \"phase\": \"fwd\"}");
    assert!(
        matches!(
            e,
            TraceError::MissingField {
                line: 2,
                field: "bytes"
            }
        ),
        "{e}"
    );
}

#[test]
fn wrong_types() {
    let cases = [
        (
            r#"{"step": "0", "buffer": "a", "bytes": 1, "phase": "fwd"}"#,
            "step",
        ),
        (
            r#"{"step": 0, "buffer": 7, "bytes": 1, "phase": "fwd"}"#,
            "buffer",
        ),
        (
            r#"{"step": 0, "buffer": "a", "bytes": null, "phase": "fwd"}"#,
            "bytes",
        ),
        (
            r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": ["fwd"]}"#,
            "phase",
        ),
        (
            r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd", "compute_us": "3"}"#,
            "compute_us",
        ),
    ];
    for (text, want) in cases {
        let e = parse_err(text);
        assert!(
            matches!(e, TraceError::WrongType { line: 1, field, .. } if field == want),
            "{text}: {e}"
        );
    }
}

#[test]
fn unknown_field_is_rejected_unless_underscored() {
    let e = parse_err(r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd", "byte": 1}"#);
    assert!(
        matches!(&e, TraceError::UnknownField { line: 1, field } if field == "byte"),
        "{e}"
    );
    parse(r#"{"step": 0, "buffer": "a", "bytes": 1, "phase": "fwd", "_byte": 1}"#).unwrap();
}

#[test]
fn duplicate_field() {
    let e = parse_err(r#"{"step": 0, "buffer": "a", "bytes": 1, "bytes": 2, "phase": "fwd"}"#);
    assert!(
        matches!(
            e,
            TraceError::DuplicateField {
                line: 1,
                field: "bytes"
            }
        ),
        "{e}"
    );
}

#[test]
fn negative_sizes_and_steps() {
    // (step, bytes, the field named, the value quoted)
    let cases = [
        ("0", "-4", "bytes", "-4"),
        ("0", "-0.5", "bytes", "-0.5"),
        ("-1", "4", "step", "-1"),
    ];
    for (step, bytes, want_field, want_value) in cases {
        let text =
            format!(r#"{{"step": {step}, "buffer": "a", "bytes": {bytes}, "phase": "fwd"}}"#);
        let e = parse_err(&text);
        assert!(
            matches!(&e, TraceError::Negative { line: 1, field, value }
                if *field == want_field && value == want_value),
            "{text}: {e}"
        );
    }
}

#[test]
fn non_integer_sizes() {
    for bytes in ["1.5", "4.0", "1e3", "18446744073709551616"] {
        let text = format!(r#"{{"step": 0, "buffer": "a", "bytes": {bytes}, "phase": "fwd"}}"#);
        let e = parse_err(&text);
        assert!(
            matches!(
                e,
                TraceError::NotAnInteger {
                    line: 1,
                    field: "bytes",
                    ..
                }
            ),
            "{bytes}: {e}"
        );
    }
}

#[test]
fn buffer_above_the_limit() {
    let ok =
        format!(r#"{{"step": 0, "buffer": "a", "bytes": {BUFFER_BYTES_MAX}, "phase": "fwd"}}"#);
    parse(&ok).unwrap();
    let text = format!(
        "{ok}\n{{\"step\": 0, \"buffer\": \"b\", \"bytes\": {}, \"phase\": \"fwd\"}}",
        BUFFER_BYTES_MAX + 1
    );
    let e = parse_err(&text);
    assert!(
        matches!(&e, TraceError::BufferTooLarge { line: 2, buffer, .. } if buffer == "b"),
        "{e}"
    );
}

#[test]
fn buffer_size_change_names_both_lines() {
    let text = concat!(
        r#"{"step": 0, "buffer": "a", "bytes": 8, "phase": "fwd"}"#,
        "\n",
        r#"{"step": 0, "buffer": "b", "bytes": 8, "phase": "fwd"}"#,
        "\n",
        r#"{"step": 0, "buffer": "a", "bytes": 0, "phase": "marker with a's name"}"#,
        "\n",
        r#"{"step": 1, "buffer": "a", "bytes": 16, "phase": "fwd"}"#,
    );
    let e = parse_err(text);
    assert!(
        matches!(
            &e,
            TraceError::BufferSizeChanged { line: 4, first_line: 1, bytes: 16, first_bytes: 8, buffer }
                if buffer == "a"
        ),
        "{e}"
    );
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn steps_going_backwards() {
    let text = concat!(
        r#"{"step": 3, "buffer": "a", "bytes": 8, "phase": "fwd"}"#,
        "\n",
        r#"{"step": 3, "buffer": "", "bytes": 0, "phase": "step"}"#,
        "\n",
        r#"{"step": 2, "buffer": "a", "bytes": 8, "phase": "fwd"}"#,
    );
    let e = parse_err(text);
    assert!(
        matches!(
            e,
            TraceError::StepWentBack {
                line: 3,
                step: 2,
                previous_step: 3,
                previous_line: 2
            }
        ),
        "{e}"
    );
}

#[test]
fn bad_compute_times() {
    for us in ["-1", "-0.001", "3600000001", "1e300"] {
        let text = format!(
            "{{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\"}}\n\
             {{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\", \"compute_us\": {us}}}"
        );
        let e = parse_err(&text);
        assert!(
            matches!(e, TraceError::BadComputeTime { line: 2, .. }),
            "{us}: {e}"
        );
    }
    // Checked on markers too.
    let e =
        parse_err(r#"{"step": 0, "buffer": "", "bytes": 0, "phase": "step", "compute_us": -2}"#);
    assert!(
        matches!(e, TraceError::BadComputeTime { line: 1, .. }),
        "{e}"
    );
}

/// Found while writing the `trace` fuzz target's oracle (fuzz/oracles/trace.rs), whose
/// invariant `compute_us <= COMPUTE_US_MAX` it broke (the 10-minute run did not reach it):
/// markers added their time to the access before them without a bound, so an access could
/// hold any multiple of COMPUTE_US_MAX, and a replay would stall for as long.
#[test]
fn marker_time_added_to_an_access_keeps_the_limit() {
    let line = |bytes: u64, us: &str| {
        format!(
            "{{\"step\": 0, \"buffer\": \"a\", \"bytes\": {bytes}, \"phase\": \"fwd\", \"compute_us\": {us}}}\n"
        )
    };
    let at_limit = format!("{}{}", line(8, "3000000000"), line(0, "600000000"));
    let trace = parse(&at_limit).unwrap();
    assert_eq!(trace.accesses[0].compute_us, Some(COMPUTE_US_MAX));
    let over = format!(
        "{}{}{}",
        line(8, "3000000000"),
        line(0, "600000000"),
        line(0, "1")
    );
    let e = parse_err(&over);
    assert!(
        matches!(e, TraceError::BadComputeTime { line: 3, limit_us, .. } if limit_us == COMPUTE_US_MAX),
        "{e}"
    );
    assert!(e.to_string().contains("3600000001 us in all"), "{e}");
}

#[test]
fn empty_buffer_name() {
    let e = parse_err(r#"{"step": 0, "buffer": "", "bytes": 8, "phase": "fwd"}"#);
    assert!(matches!(e, TraceError::EmptyBufferName { line: 1 }), "{e}");
}

#[test]
fn over_long_strings() {
    let name = "n".repeat(BUFFER_NAME_BYTES_MAX + 1);
    let e = parse_err(&format!(
        r#"{{"step": 0, "buffer": "{name}", "bytes": 8, "phase": "fwd"}}"#
    ));
    assert!(
        matches!(
            e,
            TraceError::StringTooLong {
                line: 1,
                field: "buffer",
                ..
            }
        ),
        "{e}"
    );
    let phase = "p".repeat(PHASE_BYTES_MAX + 1);
    let e = parse_err(&format!(
        r#"{{"step": 0, "buffer": "a", "bytes": 8, "phase": "{phase}"}}"#
    ));
    assert!(
        matches!(
            e,
            TraceError::StringTooLong {
                line: 1,
                field: "phase",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn empty_and_marker_only_traces_have_no_accesses() {
    let e = parse_err("");
    assert!(matches!(e, TraceError::NoAccesses { markers: 0 }), "{e}");
    let e = parse_err("\n  \n");
    assert!(matches!(e, TraceError::NoAccesses { markers: 0 }), "{e}");
    let e = parse_err(concat!(
        r#"{"step": 0, "buffer": "", "bytes": 0, "phase": "step"}"#,
        "\n",
        r#"{"step": 1, "buffer": "", "bytes": 0, "phase": "step"}"#,
    ));
    assert!(matches!(e, TraceError::NoAccesses { markers: 2 }), "{e}");
}

#[test]
fn line_too_long() {
    let padding = "x".repeat(LINE_BYTES_MAX);
    let text = format!(
        "{{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\"}}\n\
         {{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\", \"_pad\": \"{padding}\"}}\n"
    );
    let e = parse_err(&text);
    assert!(
        matches!(
            e,
            TraceError::LineTooLong {
                line: 2,
                limit_bytes: LINE_BYTES_MAX
            }
        ),
        "{e}"
    );
}

#[test]
fn too_many_accesses_and_buffers() {
    let line = |name: &str| {
        format!(r#"{{"step": 0, "buffer": "{name}", "bytes": 8, "phase": "fwd"}}"#) + "\n"
    };
    let marker = r#"{"step": 0, "buffer": "", "bytes": 0, "phase": "step"}"#.to_owned() + "\n";
    let limits = Limits {
        accesses_max: 3,
        ..Limits::DEFAULT
    };
    // Markers do not count.
    let text = [
        line("a"),
        marker.clone(),
        line("a"),
        line("a"),
        marker.clone(),
    ]
    .concat();
    parse_with_limits(text.as_bytes(), limits).unwrap();
    let text = [text, line("a")].concat();
    let e = parse_with_limits(text.as_bytes(), limits).unwrap_err();
    assert!(
        matches!(e, TraceError::TooManyAccesses { line: 6, limit: 3 }),
        "{e}"
    );

    let limits = Limits {
        buffers_max: 2,
        ..Limits::DEFAULT
    };
    let text = [line("a"), line("b"), line("a"), line("c")].concat();
    let e = parse_with_limits(text.as_bytes(), limits).unwrap_err();
    assert!(
        matches!(e, TraceError::TooManyBuffers { line: 4, limit: 2 }),
        "{e}"
    );
}

#[test]
fn missing_file() {
    let e = load_trace(Path::new("/nonexistent/spillway/trace.jsonl")).unwrap_err();
    assert!(matches!(e, TraceError::Open { .. }), "{e}");
}

#[test]
fn read_errors_name_the_line() {
    /// Yields one good line, then fails.
    struct Failing(bool);
    impl Read for Failing {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            if self.0 {
                return Err(io::Error::other("disk on fire"));
            }
            self.0 = true;
            let line = b"{\"step\": 0, \"buffer\": \"a\", \"bytes\": 8, \"phase\": \"fwd\"}\n";
            out[..line.len()].copy_from_slice(line);
            Ok(line.len())
        }
    }
    let e = parse_trace(BufReader::new(Failing(false))).unwrap_err();
    assert!(matches!(e, TraceError::Read { line: 2, .. }), "{e}");
}

/// The example traces under `bench/traces` (recorded by `python/spillway_trace.py`, see
/// the README there) parse, with the counts they were recorded with. Re-recording them
/// changes `compute_us` only; a change of model or step count must update these numbers.
#[test]
fn example_traces_parse() {
    struct Expected {
        name: &'static str,
        accesses: usize,
        markers: u64,
        steps: u64,
        buffers: usize,
        buffer_bytes: u64,
    }
    let cases = [
        Expected {
            name: "dense",
            accesses: 432,
            markers: 8,
            steps: 8,
            buffers: 27,
            buffer_bytes: 83_963_904,
        },
        Expected {
            name: "checkpoint_accum",
            accesses: 936,
            markers: 6,
            steps: 6,
            buffers: 27,
            buffer_bytes: 83_963_904,
        },
        Expected {
            name: "moe",
            accesses: 696,
            markers: 8,
            steps: 8,
            buffers: 71,
            buffer_bytes: 79_824_896,
        },
        Expected {
            name: "mixtral_b1",
            accesses: 2052,
            markers: 12,
            steps: 12,
            // One of the 64 experts was never routed to in 12 steps of 4 tokens.
            buffers: 122,
            buffer_bytes: 112_804_864,
        },
        Expected {
            name: "mixtral_b4",
            accesses: 2742,
            markers: 12,
            steps: 12,
            buffers: 123,
            buffer_bytes: 114_377_728,
        },
    ];
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/traces"));
    for want in cases {
        let trace = load_trace(&dir.join(format!("{}.jsonl", want.name)))
            .unwrap_or_else(|e| panic!("{}: {e}", want.name));
        assert_eq!(trace.accesses.len(), want.accesses, "{}", want.name);
        assert_eq!(trace.markers_skipped, want.markers, "{}", want.name);
        assert_eq!(
            trace.steps,
            (0..want.steps).collect::<Vec<_>>(),
            "{}",
            want.name
        );
        assert_eq!(trace.buffers.len(), want.buffers, "{}", want.name);
        assert_eq!(
            trace.buffer_bytes_total(),
            want.buffer_bytes,
            "{}",
            want.name
        );
        let per_step: usize = trace.accesses_by_step().map(|(_, a)| a.len()).sum();
        assert_eq!(per_step, want.accesses);
        for (step, accesses) in trace.accesses_by_step() {
            assert_eq!(accesses, trace.step_accesses(step));
            // Each step runs forward, then backward, and the recorder timed every access.
            assert_eq!(accesses[0].phase, "fwd", "{} step {step}", want.name);
            assert!(accesses.iter().any(|a| a.phase == "bwd"));
            assert!(accesses.iter().all(|a| a.compute_us.is_some()));
        }
    }

    let checkpoint = load_trace(&dir.join("checkpoint_accum.jsonl")).unwrap();
    let recomputed = checkpoint
        .accesses
        .iter()
        .filter(|a| a.phase == "bwd-recompute")
        .count();
    assert_eq!(recomputed, 288);

    let moe = load_trace(&dir.join("moe.jsonl")).unwrap();
    let fused = moe
        .accesses
        .iter()
        .filter(|a| a.buffer.contains(".expert"))
        .count();
    let listed = moe
        .accesses
        .iter()
        .filter(|a| a.buffer.contains(".experts."))
        .count();
    assert!(fused > 0 && listed > 0, "fused {fused}, listed {listed}");
}
