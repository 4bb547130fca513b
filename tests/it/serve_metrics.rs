//! The engines' and the proxy's `/metrics` read by a real Prometheus text-format parser
//! (`openmetrics-parser`), not by string matching: vLLM's families with vLLM's names, types,
//! label names and bucket bounds, kvx's own beside them, and the values a request leaves.
//! Real HTTP on loopback port 0; every test runs under a hard timeout.

use std::time::Duration;

use axum::http::StatusCode;
use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::{MetricFamily, MetricsExposition, PrometheusType, PrometheusValue};

use crate::serve::{post, send};

const HARD_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) type Families = MetricsExposition<PrometheusType, PrometheusValue>;

/// Scrapes `url` and parses the exposition; a parse error (duplicate family, bad line,
/// counter without `_total`...) fails the test, and so does a family the parser did not
/// take whole (see [`check_every_family_parsed`]).
pub(crate) async fn scrape(url: &str) -> Families {
    let (status, h, text) = send("GET", url, &[], "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let f = parse_prometheus(&text)
        .unwrap_or_else(|e| panic!("not a valid Prometheus exposition ({e:?}):\n{text}"));
    check_every_family_parsed(&text, &f);
    f
}

/// Every family the text declares (`# TYPE name kind`) is in the parse, with that type and
/// at least one sample, and the parse holds nothing else: so whatever families an engine, the
/// proxy or `kvx bench --metrics-port` expose, each one is read by the parser, not only the
/// ones a test looks up by name.
pub(crate) fn check_every_family_parsed(text: &str, f: &Families) {
    let declared: Vec<(&str, &str)> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_once(' ')).collect();
    assert!(!declared.is_empty(), "no # TYPE line:\n{text}");
    for (name, kind) in &declared {
        let fam = f.families.get(*name).unwrap_or_else(|| panic!("family {name} declared but not parsed"));
        assert_eq!(fam.family_type.to_string(), *kind, "{name}: type");
        assert!(fam.iter_samples().next().is_some(), "{name}: declared without a sample");
    }
    assert_eq!(f.families.len(), declared.len(), "families parsed vs declared: {declared:?}");
}

pub(crate) fn family<'a>(
    f: &'a Families,
    name: &str,
    kind: PrometheusType,
) -> &'a MetricFamily<PrometheusType, PrometheusValue> {
    let fam = f.families.get(name).unwrap_or_else(|| {
        let mut names: Vec<&String> = f.families.keys().collect();
        names.sort();
        panic!("family {name} missing; present: {names:?}")
    });
    assert_eq!(fam.family_type, kind, "{name}");
    fam
}

/// The sample of a family with these labels (any order).
pub(crate) fn value<'a>(
    fam: &'a MetricFamily<PrometheusType, PrometheusValue>,
    labels: &[(&str, &str)],
) -> &'a PrometheusValue {
    let names = fam.get_label_names();
    assert_eq!(names.len(), labels.len(), "{}: labels {names:?}", fam.family_name);
    let want: Vec<String> = names
        .iter()
        .map(|n| {
            labels
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_string())
                .unwrap_or_else(|| panic!("{}: label {n} not given", fam.family_name))
        })
        .collect();
    &fam.get_sample_by_label_values(&want)
        .unwrap_or_else(|| panic!("{}: no sample {labels:?}", fam.family_name))
        .value
}

/// The family's label names, sorted (the parser keeps them in its own order).
fn label_names(fam: &MetricFamily<PrometheusType, PrometheusValue>) -> Vec<&str> {
    let mut v: Vec<&str> = fam.get_label_names().iter().map(String::as_str).collect();
    v.sort_unstable();
    v
}

pub(crate) fn number(v: &PrometheusValue) -> f64 {
    match v {
        PrometheusValue::Counter(c) => c.value.as_f64(),
        PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
        other => panic!("not a number: {other:?}"),
    }
}

/// `(bucket bounds, count, sum)` of a histogram sample.
pub(crate) fn histogram(v: &PrometheusValue) -> (Vec<f64>, u64, f64) {
    match v {
        PrometheusValue::Histogram(h) => (
            h.buckets.iter().map(|b| b.upper_bound).filter(|b| b.is_finite()).collect(),
            h.count.unwrap_or(0),
            h.sum.map_or(0.0, |s| s.as_f64()),
        ),
        other => panic!("not a histogram: {other:?}"),
    }
}

/// vLLM's NIXL connector buckets, written out here independently of kvx's constants.
pub(crate) const XFER_BUCKETS: [f64; 12] =
    [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];
pub(crate) const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// Checks the vLLM families every engine serves, with vLLM's types and label names.
pub(crate) fn check_vllm_families(f: &Families) {
    use PrometheusType::{Counter, Gauge, Histogram};
    let vl = ["engine", "model_name"];
    for (name, kind) in [
        ("vllm:num_requests_running", Gauge),
        ("vllm:num_requests_waiting", Gauge),
        ("vllm:kv_cache_usage_perc", Gauge),
        ("vllm:prompt_tokens_total", Counter),
        ("vllm:generation_tokens_total", Counter),
        ("vllm:time_to_first_token_seconds", Histogram),
        ("vllm:inter_token_latency_seconds", Histogram),
        ("vllm:request_time_per_output_token_seconds", Histogram),
        ("vllm:e2e_request_latency_seconds", Histogram),
        ("vllm:nixl_xfer_time_seconds", Histogram),
        ("vllm:nixl_post_time_seconds", Histogram),
        ("vllm:nixl_bytes_transferred", Histogram),
        ("vllm:nixl_num_descriptors", Histogram),
        ("vllm:nixl_num_failed_transfers_total", Counter),
        ("vllm:nixl_num_failed_notifications_total", Counter),
        ("vllm:nixl_num_kv_expired_reqs_total", Counter),
    ] {
        let fam = family(f, name, kind);
        assert_eq!(label_names(fam), vl, "{name}: vLLM's label names");
    }
    let fam = family(f, "vllm:request_success_total", Counter);
    assert_eq!(label_names(fam), ["engine", "finished_reason", "model_name"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_and_proxy_serve_vllm_families_a_parser_reads() {
    tokio::time::timeout(HARD_TIMEOUT, async {
        let mut d_cfg =
            kvx::config::serve::HttpEngineConfig::new(kvx::vocab::kinds::Role::Decode, "stub-model");
        d_cfg.itl = Duration::from_millis(2);
        let s = crate::serve::stack_with_cfg(d_cfg).await;
        let body = r#"{"model":"stub-model","prompt":"a b c d","max_tokens":3,"stream":true}"#;
        let (status, _, text) = post(&s.proxy.url("/v1/completions"), &[], body).await;
        assert_eq!(status, StatusCode::OK, "{text}");

        let d = scrape(&s.d_url("/metrics")).await;
        check_vllm_families(&d);
        let me = [("model_name", "stub-model"), ("engine", "0")];
        let ttft =
            histogram(value(family(&d, "vllm:time_to_first_token_seconds", PrometheusType::Histogram), &me));
        assert_eq!(ttft.1, 1);
        assert_eq!(ttft.0[0], 0.001, "vLLM's TTFT buckets start at 1 ms");
        assert_eq!(ttft.0.len(), 22);
        let itl =
            histogram(value(family(&d, "vllm:inter_token_latency_seconds", PrometheusType::Histogram), &me));
        assert_eq!(itl.0, ITL_BUCKETS);
        assert_eq!(itl.1, 2, "3 tokens, 2 gaps");
        assert!(itl.2 >= 0.003, "two 2 ms steps (timers round up, never down): {}", itl.2);
        let tpot = histogram(value(
            family(&d, "vllm:request_time_per_output_token_seconds", PrometheusType::Histogram),
            &me,
        ));
        assert_eq!((tpot.0.as_slice(), tpot.1), (ITL_BUCKETS.as_slice(), 1));
        let xfer =
            histogram(value(family(&d, "vllm:nixl_xfer_time_seconds", PrometheusType::Histogram), &me));
        assert_eq!(xfer.0, XFER_BUCKETS);
        assert_eq!(xfer.1, 0, "NullKv moves nothing");
        let bytes =
            histogram(value(family(&d, "vllm:nixl_bytes_transferred", PrometheusType::Histogram), &me));
        assert_eq!(bytes.0.first().copied(), Some(2048.0));
        assert_eq!(bytes.0.last().copied(), Some(8_589_934_592.0));
        let descs = histogram(value(family(&d, "vllm:nixl_num_descriptors", PrometheusType::Histogram), &me));
        assert_eq!(descs.0.len(), 14);
        assert_eq!(
            number(value(family(&d, "vllm:generation_tokens_total", PrometheusType::Counter), &me)),
            3.0
        );
        assert_eq!(number(value(family(&d, "vllm:prompt_tokens_total", PrometheusType::Counter), &me)), 4.0);
        let ok = value(
            family(&d, "vllm:request_success_total", PrometheusType::Counter),
            &[("model_name", "stub-model"), ("engine", "0"), ("finished_reason", "length")],
        );
        assert_eq!(number(ok), 1.0);
        // kvx's own families are still there, with their labels.
        let loads = family(&d, "kvx:kv_loads_total", PrometheusType::Counter);
        assert_eq!(number(value(loads, &[("model_name", "stub-model"), ("result", "ok")])), 1.0);

        let p = scrape(&s.p_url("/metrics")).await;
        check_vllm_families(&p);
        assert_eq!(
            number(value(family(&p, "vllm:nixl_num_kv_expired_reqs_total", PrometheusType::Counter), &me)),
            0.0
        );
        let x = scrape(&s.proxy.url("/metrics")).await;
        let reqs = family(&x, "kvx:proxy_requests_total", PrometheusType::Counter);
        assert_eq!(number(value(reqs, &[("code", "2xx")])), 1.0);
        family(&x, "kvx:proxy_no_healthy_backend_total", PrometheusType::Counter);
    })
    .await
    .expect("test exceeded its hard timeout");
}
