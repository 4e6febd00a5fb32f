//! What a [`Recorder`] holds, written out: Chrome / Perfetto trace JSON and a terminal timeline.

use super::*;

/// The recorder's spans as Chrome trace JSON (`traceEvents` of complete events, one process per
/// rank, one thread per stream track, tracks named by `thread_name` metadata), which Perfetto
/// and `chrome://tracing` open.
pub fn chrome_trace(rec: &Recorder) -> Value {
    let tracks = rec.tracks();
    let mut events = Vec::new();
    let samples = rec.memory_samples();
    let mut ranks: Vec<usize> = tracks
        .iter()
        .map(|t| t.rank)
        .chain(samples.iter().map(|m| m.rank))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        events.push(
            json!({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
            "args": {"name": format!("rank {r}")}}),
        );
        events.push(
            json!({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
            "args": {"sort_index": r}}),
        );
    }
    // Tracks sorted by section (run order), then role, so each configuration reads top-down.
    let mut sections: Vec<&str> = Vec::new();
    for t in &tracks {
        if !sections.contains(&t.section.as_str()) {
            sections.push(&t.section);
        }
    }
    for (i, t) in tracks.iter().enumerate() {
        let name = if t.section.is_empty() {
            t.label.clone()
        } else {
            format!("{} [{}]", t.label, t.section)
        };
        let section_order = sections.iter().position(|s| *s == t.section).unwrap_or(0);
        let role_order = Role::ALL.iter().position(|r| *r == t.role).unwrap_or(0);
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": t.rank, "tid": i + 1,
            "args": {"name": name}}),
        );
        events.push(
            json!({"name": "thread_sort_index", "ph": "M", "pid": t.rank, "tid": i + 1,
            "args": {"sort_index": section_order * 1000 + role_order * 100 + i}}),
        );
    }
    // The memory counter tracks, one per rank and section, beside that rank's stream tracks.
    for m in samples {
        let name = if m.section.is_empty() {
            "device memory in use".to_string()
        } else {
            format!("device memory in use [{}]", m.section)
        };
        events.push(json!({
            "name": name,
            "ph": "C",
            "ts": m.at_us,
            "pid": m.rank,
            "args": {"MiB": m.device_bytes as f64 / (1u64 << 20) as f64},
        }));
    }
    let mut spans = rec.spans();
    spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    for s in spans {
        let t = &tracks[s.track];
        let mut args = json!({"bytes": s.bytes, "op": s.op, "stream": t.label});
        if let Some(l) = s.layer {
            args["layer"] = json!(l);
        }
        if s.name != s.op {
            args["tensor"] = json!(s.name);
        }
        events.push(json!({
            "name": s.name,
            "cat": t.role.name(),
            "ph": "X",
            "ts": s.start_us,
            "dur": (s.end_us - s.start_us).max(0.0),
            "pid": t.rank,
            "tid": s.track + 1,
            "args": args,
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Writes [`chrome_trace`] to `path`.
pub fn write_chrome_trace(rec: &Recorder, path: &std::path::Path) -> std::io::Result<()> {
    let text = serde_json::to_string(&chrome_trace(rec)).map_err(std::io::Error::other)?;
    std::fs::write(path, text)
}

/// A compact ASCII picture of `rank`'s tracks in `section` between two recorder times: one row
/// per track, `width` columns; a column shows the layer (mod 10) of the span that covers most
/// of it, `*` for work outside any layer, `.` when the stream was idle.
pub fn timeline(
    rec: &Recorder,
    rank: usize,
    section: &str,
    from_us: f64,
    to_us: f64,
    width: usize,
) -> String {
    let tracks = rec.tracks();
    let spans = rec.spans();
    let mut rows: Vec<(usize, &Track)> = tracks
        .iter()
        .enumerate()
        .filter(|(_, t)| t.rank == rank && t.section == section)
        .collect();
    rows.sort_by_key(|(i, t)| (t.role, *i));
    let width = width.max(10);
    let columns = column_bounds(from_us, to_us, width);
    let label_w = rows.iter().map(|(_, t)| t.label.len()).max().unwrap_or(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:label_w$} |0 ms{:>w$}|",
        "",
        format!("{:.1} ms", (to_us - from_us) / 1e3),
        w = width - 4
    );
    for (i, t) in rows {
        let mine: Vec<&Span> = spans
            .iter()
            .filter(|s| s.track == i && s.end_us > from_us && s.start_us < to_us)
            .collect();
        if mine.is_empty() && t.role == Role::Other {
            continue;
        }
        let mut line = String::with_capacity(width);
        for &(lo, hi) in &columns {
            let best = mine
                .iter()
                .map(|s| (s.end_us.min(hi) - s.start_us.max(lo), s))
                .filter(|(overlap, _)| *overlap > 0.0)
                .max_by(|a, b| a.0.total_cmp(&b.0));
            line.push(match best {
                None => '.',
                Some((_, s)) => s.layer.map_or('*', |l| {
                    char::from_digit((l % 10) as u32, 10).unwrap_or('*')
                }),
            });
        }
        let _ = writeln!(out, "{:label_w$} |{line}|", t.label);
    }
    if let Some(row) = memory_row(rec, rank, section, to_us, &columns) {
        let _ = writeln!(out, "{:label_w$} |{row}|", "memory");
    }
    out
}

/// The `width` equal columns of the timeline from `from_us` to `to_us`, each as its start and
/// end; the track rows and the memory row share them so their columns line up.
fn column_bounds(from_us: f64, to_us: f64, width: usize) -> Vec<(f64, f64)> {
    let bucket = (to_us - from_us).max(1.0) / width as f64;
    (0..width)
        .map(|c| {
            (
                from_us + c as f64 * bucket,
                from_us + (c + 1) as f64 * bucket,
            )
        })
        .collect()
}

/// Levels of the timeline's memory row, lowest to highest.
const MEMORY_LEVELS: &[u8; 10] = b" .:-=+*#%@";

/// The timeline's memory row: per column, the most device memory in use during it (the last
/// sample before it counts from the column's start), as a level of the highest value in the
/// window; `None` without samples of `rank` in `section`.
fn memory_row(
    rec: &Recorder,
    rank: usize,
    section: &str,
    to_us: f64,
    columns: &[(f64, f64)],
) -> Option<String> {
    let mut mine: Vec<(f64, u64)> = rec
        .memory_samples()
        .into_iter()
        .filter(|m| m.rank == rank && m.section == section && m.at_us < to_us)
        .map(|m| (m.at_us, m.device_bytes))
        .collect();
    mine.sort_by(|a, b| a.0.total_cmp(&b.0));
    let columns: Vec<u64> = columns
        .iter()
        .map(|&(lo, hi)| {
            let before = mine.iter().rev().find(|m| m.0 <= lo).map(|m| m.1);
            let during = mine.iter().filter(|m| m.0 > lo && m.0 < hi).map(|m| m.1);
            before.into_iter().chain(during).max().unwrap_or(0)
        })
        .collect();
    let top = *columns.iter().max()?;
    if top == 0 {
        return None;
    }
    Some(
        columns
            .iter()
            .map(|&v| {
                let level = (v as f64 / top as f64 * 9.0).round() as usize;
                MEMORY_LEVELS[level.min(9)] as char
            })
            .collect(),
    )
}

/// `HP_TRACE`: where to write a trace, if set and not empty.
pub fn trace_path_from_env() -> Option<std::path::PathBuf> {
    std::env::var_os("HP_TRACE")
        .filter(|v| !v.is_empty())
        .map(Into::into)
}
