//! Pure exporters to machine formats: the summary as pretty JSON, request rows and stage rows
//! as CSV, sweep points as CSV, and the parsers that read them back.
//!
//! Owns the exact bytes of `summary.json`, `requests.csv`, `stages.csv` and `sweep.csv`. Must
//! not touch the file system: `files.rs` writes what these functions return.

use serde::Serialize;

use super::ReportError;
use super::summary::{RequestRow, Summary, ordered_stage_names};

/// A report's JSON as a command prints it: pretty, with a newline.
pub fn pretty_json(value: &impl Serialize) -> serde_json::Result<String> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(text)
}

/// The summary as pretty JSON with a trailing newline.
///
/// Refuses a summary that would not read back: JSON has no NaN or infinity (serde_json writes
/// them as `null`), and a file `kvx report` and `kvx gate` cannot load is worse than an error now.
pub fn summary_json(s: &Summary) -> Result<Vec<u8>, ReportError> {
    let mut out = serde_json::to_vec_pretty(s)
        .map_err(|e| ReportError::Encode { what: "summary JSON", reason: e.to_string() })?;
    if let Err(e) = serde_json::from_slice::<Summary>(&out) {
        return Err(ReportError::Encode {
            what: "summary JSON",
            reason: format!("it would not read back ({e}); is a figure NaN or infinite?"),
        });
    }
    out.push(b'\n');
    Ok(out)
}

/// A CSV writer with the header row written by hand, so a file streamed row by row
/// (`RunWriter`) and one written at once are byte-identical, header included, even with no rows.
pub(crate) fn requests_csv_writer<W: std::io::Write>(w: W) -> Result<csv::Writer<W>, csv::Error> {
    let mut writer = csv::WriterBuilder::new().has_headers(false).from_writer(w);
    writer.write_record(RequestRow::HEADERS)?;
    Ok(writer)
}

fn csv_err(what: &'static str) -> impl Fn(csv::Error) -> ReportError {
    move |e| ReportError::Encode { what, reason: e.to_string() }
}

/// `requests.csv`: one line per request.
pub fn requests_csv(rows: &[RequestRow]) -> Result<Vec<u8>, ReportError> {
    let mut w = requests_csv_writer(Vec::new()).map_err(csv_err("requests CSV"))?;
    for row in rows {
        w.serialize(row).map_err(csv_err("requests CSV"))?;
    }
    w.into_inner().map_err(|e| ReportError::Encode { what: "requests CSV", reason: e.to_string() })
}

/// Parses `requests.csv` (as written by [`requests_csv`] or `RunWriter`).
///
/// A last line cut short by a killed run is dropped rather than failing the whole file: a
/// partial run keeps every complete row.
pub fn parse_requests_csv(bytes: &[u8]) -> Result<Vec<RequestRow>, csv::Error> {
    // Rows are written whole, each with its newline: text after the last newline is a row cut
    // short, even where what is left of it would parse (its last columns are optional).
    let bytes = match bytes.iter().rposition(|b| *b == b'\n') {
        Some(i) => &bytes[..=i],
        None => bytes,
    };
    let mut reader = csv::ReaderBuilder::new().has_headers(true).flexible(true).from_reader(bytes);
    let mut rows = Vec::new();
    let mut records = reader.deserialize::<RequestRow>().peekable();
    while let Some(rec) = records.next() {
        match rec {
            Ok(row) => rows.push(row),
            Err(_) if records.peek().is_none() && !bytes.ends_with(b"\n") => break,
            Err(e) => return Err(e),
        }
    }
    Ok(rows)
}

#[derive(Serialize)]
struct StageCsvRow<'a> {
    stage: &'a str,
    count: u64,
    mean_us: f64,
    min_us: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
}

/// `stages.csv`: one line per stage, in display order.
pub fn stages_csv(s: &Summary) -> Result<Vec<u8>, ReportError> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for name in ordered_stage_names(&s.stages) {
        let st = &s.stages[name];
        w.serialize(StageCsvRow {
            stage: name,
            count: st.count,
            mean_us: st.mean_us,
            min_us: st.min_us,
            p50_us: st.p50_us,
            p90_us: st.p90_us,
            p99_us: st.p99_us,
            p999_us: st.p999_us,
            max_us: st.max_us,
        })
        .map_err(csv_err("stages CSV"))?;
    }
    w.into_inner().map_err(|e| ReportError::Encode { what: "stages CSV", reason: e.to_string() })
}

/// `sweep.csv`: one line per sweep point; parameter columns are the union of every point's
/// parameters, then the headline figures. Empty when the run is not a sweep.
pub fn sweep_csv(s: &Summary) -> Result<Vec<u8>, ReportError> {
    let Some(points) = s.sweep.as_deref() else { return Ok(Vec::new()) };
    let params: std::collections::BTreeSet<&str> =
        points.iter().flat_map(|p| p.params.keys().map(String::as_str)).collect();
    let mut w = csv::Writer::from_writer(Vec::new());
    let mut header: Vec<&str> = vec!["label", "series"];
    header.extend(params.iter().copied());
    header.extend([
        "block_size",
        "bytes_per_descriptor",
        "throughput_gbps",
        "requests_per_s",
        "transfer_p50_us",
        "e2e_p50_us",
        "descriptors_raw",
        "descriptors_coalesced",
        "requests_ok",
        "requests_failed",
    ]);
    w.write_record(&header).map_err(csv_err("sweep CSV"))?;
    let opt = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
    for p in points {
        let mut rec: Vec<String> = vec![p.label.clone(), p.series.clone().unwrap_or_default()];
        rec.extend(
            params.iter().map(|k| p.params.get(*k).map(super::summary::display_value).unwrap_or_default()),
        );
        rec.extend([
            p.block_size.map(|b| b.to_string()).unwrap_or_default(),
            opt(p.bytes_per_descriptor),
            p.throughput_gbps.to_string(),
            p.requests_per_s.to_string(),
            opt(p.transfer_p50_us),
            opt(p.e2e_p50_us),
            opt(p.descriptors_per_request.map(|d| d.raw)),
            opt(p.descriptors_per_request.map(|d| d.coalesced)),
            p.requests_ok.to_string(),
            p.requests_failed.to_string(),
        ]);
        w.write_record(&rec).map_err(csv_err("sweep CSV"))?;
    }
    w.into_inner().map_err(|e| ReportError::Encode { what: "sweep CSV", reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::{
        RankList, RankRead, RankReads, RequestOutcome, Scenario, StageStats, SweepPoint,
    };

    fn row(i: u32) -> RequestRow {
        RequestRow {
            request_id: format!("req-{i}"),
            repeat: 0,
            start_offset_us: f64::from(i) * 10.5,
            prompt_tokens: 8192,
            blocks: 512,
            bytes: 1 << 20,
            descriptors_raw: 1024,
            descriptors_coalesced: 80,
            queue_us: Some(1.5),
            handshake_us: None,
            plan_us: Some(0.25),
            post_us: Some(3.0),
            transfer_us: Some(120.0),
            transfer_span_us: Some(125.0),
            notify_us: Some(4.0),
            e2e_us: Some(130.0),
            outcome: if i == 2 { RequestOutcome::Failed } else { RequestOutcome::Ok },
            failure_cause: (i == 2).then(|| "p rank 3 died, \"quoted\"".to_string()),
            d_ranks: RankList(vec![0, i]),
            verify_us: (i != 2).then_some(50.5),
            rank_reads: RankReads(vec![
                RankRead { rank: 0, start_us: Some(0.0), read_us: 120.0, bytes: 1 << 19 },
                RankRead { rank: i, start_us: (i != 1).then_some(2.5), read_us: 117.25, bytes: 1 << 19 },
            ]),
        }
    }

    #[test]
    fn headers_match_the_serialized_fields() {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.serialize(row(1)).expect("row");
        let bytes = w.into_inner().expect("bytes");
        let text = String::from_utf8(bytes).expect("utf8");
        assert_eq!(text.lines().next(), Some(RequestRow::HEADERS.join(",").as_str()));
    }

    #[test]
    fn requests_csv_round_trips() {
        let rows: Vec<RequestRow> = (0..4).map(row).collect();
        let bytes = requests_csv(&rows).expect("csv");
        let text = String::from_utf8(bytes.clone()).expect("utf8");
        assert_eq!(text.lines().count(), 5);
        assert!(
            text.lines().nth(1).is_some_and(|l| l.starts_with("req-0,0,0.0,8192,512,1048576,1024,80,1.5,,"))
        );
        assert_eq!(parse_requests_csv(&bytes).expect("parse"), rows);
        // Header only when there are no rows.
        assert_eq!(
            requests_csv(&[]).expect("empty"),
            format!("{}\n", RequestRow::HEADERS.join(",")).into_bytes()
        );
    }

    #[test]
    fn a_cut_last_line_is_dropped_but_a_bad_middle_line_is_an_error() {
        let rows: Vec<RequestRow> = (0..3).map(row).collect();
        let bytes = requests_csv(&rows).expect("csv");
        let cut = &bytes[..bytes.len() - 20];
        assert_eq!(parse_requests_csv(cut).expect("parse"), rows[..2].to_vec());
        let mut bad = String::from_utf8(bytes).expect("utf8");
        bad = bad.replacen("req-1,0,10.5,8192", "req-1,0,10.5,many", 1);
        assert!(parse_requests_csv(bad.as_bytes()).is_err());
    }

    #[test]
    fn stages_csv_in_display_order() {
        let mut s = Summary::new("r", "t", Scenario::default());
        for (i, k) in ["e2e", "post", "custom"].into_iter().enumerate() {
            let v = (i + 1) as f64;
            s.stages.insert(k.into(), StageStats { count: 3, p50_us: v, ..Default::default() });
        }
        let text = String::from_utf8(stages_csv(&s).expect("csv")).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "stage,count,mean_us,min_us,p50_us,p90_us,p99_us,p999_us,max_us");
        assert_eq!(lines[1], "post,3,0.0,0.0,2.0,0.0,0.0,0.0,0.0");
        assert!(lines[2].starts_with("e2e,"));
        assert!(lines[3].starts_with("custom,"));
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn sweep_csv_has_union_of_params() {
        let mut s = Summary::new("r", "t", Scenario::default());
        assert!(sweep_csv(&s).expect("none").is_empty());
        let mut a = SweepPoint { label: "a".into(), throughput_gbps: 1.5, ..Default::default() };
        a.params.insert("layout".into(), "nhd".into());
        let mut b = SweepPoint { label: "b".into(), block_size: Some(16), ..Default::default() };
        b.params.insert("p_tp".into(), 8.into());
        s.sweep = Some(vec![a, b]);
        let text = String::from_utf8(sweep_csv(&s).expect("csv")).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("label,series,layout,p_tp,block_size,"), "{}", lines[0]);
        assert!(lines[1].starts_with("a,,nhd,,,,1.5,"), "{}", lines[1]);
        assert!(lines[2].starts_with("b,,,8,16,"), "{}", lines[2]);
    }

    #[test]
    fn non_finite_figures_are_refused() {
        let mut s = Summary::new("r", "t", Scenario::default());
        s.throughput_gbps = f64::NAN;
        let e = summary_json(&s).expect_err("NaN");
        assert!(e.to_string().contains("NaN or infinite"), "{e}");
    }

    #[test]
    fn summary_json_round_trips() {
        let mut s = Summary::new("r", "t", Scenario { p_tp: Some(8), ..Default::default() });
        s.stages.insert("e2e".into(), StageStats { count: 1, p50_us: 2.5, ..Default::default() });
        let bytes = summary_json(&s).expect("json");
        assert!(bytes.ends_with(b"}\n"));
        let back: Summary = serde_json::from_slice(&bytes).expect("parse");
        assert_eq!(back, s);
    }
}
