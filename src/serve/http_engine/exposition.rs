//! The engine's `/metrics`: vLLM's families under vLLM's names, types, labels and buckets
//! (the NIXL connector's from the backend), and kvx's own `kvx:*`, rendered from the
//! [`EngineState`]'s counters and its backend's.

use super::state::EngineState;
use crate::serve::metrics::Exposition;

impl EngineState {
    /// Renders `/metrics`: vLLM's families under vLLM's names and labels (`model_name`,
    /// `engine="0"`), kvx's own under `kvx:`.
    pub fn render_metrics(&self) -> String {
        let mut e = Exposition::new();
        self.render_into(&mut e, None);
        e.finish()
    }

    /// Adds this engine's families to `e`. `engine` labels this engine among several in one
    /// exposition (`kvx bench --serve --metrics-port`: `prefill`, `decode`); `None` is a lone
    /// engine, which vLLM labels `engine="0"`.
    pub fn render_into(&self, e: &mut Exposition, engine: Option<&str>) {
        let m = &self.metrics;
        let name = self.cfg.model_name.as_str();
        let vl = [("model_name", name), ("engine", engine.unwrap_or("0"))];
        let b = self.backend.metrics();
        // kvx's own families keep their labels; with several engines they also name theirs.
        let model: Vec<(&str, &str)> = match engine {
            None => vec![("model_name", name)],
            Some(en) => vec![("model_name", name), ("engine", en)],
        };
        let with = |extra: (&'static str, &'static str)| {
            let mut l = model.clone();
            l.push(extra);
            l
        };
        e.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &vl,
            m.running.get() as f64,
        );
        e.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &vl,
            m.waiting.get() as f64,
        );
        let usage = if b.pool_blocks > 0 { b.blocks_in_use as f64 / b.pool_blocks as f64 } else { 0.0 };
        e.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &vl, usage);
        e.counter(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            &vl,
            m.prompt_tokens.get(),
        );
        e.counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            &vl,
            m.generation_tokens.get(),
        );
        let help = "Count of successfully processed requests.";
        let success = "vllm:request_success_total";
        for (reason, n) in [
            ("stop", m.success_stop.get()),
            ("length", m.success_length.get()),
            ("abort", m.aborted.get()),
            ("error", m.failed.get()),
        ] {
            e.counter(success, help, &[vl[0], vl[1], ("finished_reason", reason)], n);
        }
        e.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &vl,
            &m.ttft.snapshot(),
        );
        e.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &vl,
            &m.itl.snapshot(),
        );
        e.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &vl,
            &m.tpot.snapshot(),
        );
        e.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &vl,
            &m.e2e.snapshot(),
        );
        // The NIXL connector's families (vLLM's NixlPromMetrics), from the backend.
        let nx = &b.nixl;
        e.histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            &vl,
            &nx.xfer_time,
        );
        e.histogram(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            &vl,
            &nx.post_time,
        );
        e.histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            &vl,
            &nx.bytes_transferred,
        );
        e.histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            &vl,
            &nx.num_descriptors,
        );
        e.counter(
            "vllm:nixl_num_failed_transfers_total",
            "Number of failed NIXL KV Cache transfers.",
            &vl,
            nx.failed_transfers,
        );
        e.counter(
            "vllm:nixl_num_failed_notifications_total",
            "Number of failed NIXL KV Cache notifications.",
            &vl,
            nx.failed_notifications,
        );
        e.counter(
            "vllm:nixl_num_kv_expired_reqs_total",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            &vl,
            nx.kv_expired_reqs,
        );

        e.counter(
            "kvx:request_errors_total",
            "Requests answered with an error status.",
            &model,
            m.errors.get(),
        );
        let role = self.cfg.role.as_str();
        let bl_own = [("backend", b.backend), ("kv_transfer", b.kv_transfer), ("role", role)];
        let bl: Vec<(&str, &str)> = match engine {
            None => bl_own.to_vec(),
            Some(en) => {
                let mut v = bl_own.to_vec();
                v.push(("engine", en));
                v
            }
        };
        let bl_with = |extra: (&'static str, &'static str)| {
            let mut l = bl.clone();
            l.push(extra);
            l
        };
        e.gauge(
            "kvx:kv_backend_info",
            "KV backend of this engine; kv_transfer=\"none\" means no KV moves (NullKv).",
            &bl,
            1.0,
        );
        e.counter(
            "kvx:kv_prefill_handoffs_total",
            "Prefill requests whose KV was held for a decode engine.",
            &model,
            m.kv_handoffs.get(),
        );
        let help = "Decode requests that loaded KV from a prefill engine.";
        e.counter("kvx:kv_loads_total", help, &with(("result", "ok")), m.kv_loads.get());
        e.counter("kvx:kv_loads_total", help, &with(("result", "error")), m.kv_load_failures.get());
        e.histogram(
            "kvx:kv_load_seconds",
            "Wall time of the backend load per request (handshake, reads, verify).",
            &model,
            &m.kv_load_seconds.snapshot(),
        );
        let help = "Decode requests that arrived without usable kv_transfer_params and were prefilled locally (the silent-fallback trap).";
        let name = "kvx:decode_local_prefill_total";
        e.counter(name, help, &with(("reason", "missing")), m.fallback_missing.get());
        e.counter(name, help, &with(("reason", "incomplete")), m.fallback_incomplete.get());
        e.counter(name, help, &with(("reason", "do_remote_decode")), m.fallback_wrong_direction.get());
        e.histogram(
            "kvx:kv_transfer_seconds",
            "Wall time of each successful backend load (queue, handshake, reads, notify, verify).",
            &bl,
            &b.load_seconds,
        );
        for (stage, h) in &b.stage_seconds {
            e.histogram(
                "kvx:kv_stage_seconds",
                "Per-request time of one KV stage, slowest rank (decode: queue..verify; prefill: fill).",
                &bl_with(("stage", stage)),
                h,
            );
        }
        e.counter(
            "kvx:kv_prefills_total",
            "Prefills whose blocks the backend filled and held.",
            &bl,
            b.prefills,
        );
        e.counter(
            "kvx:kv_prefill_failures_total",
            "Prefills the backend could not fill and hold.",
            &bl,
            b.prefill_failures,
        );
        e.counter(
            "kvx:kv_backend_loads_total",
            "Loads the backend finished.",
            &bl_with(("result", "ok")),
            b.loads_ok,
        );
        e.counter(
            "kvx:kv_backend_loads_total",
            "Loads the backend finished.",
            &bl_with(("result", "error")),
            b.loads_failed,
        );
        for (cause, n) in &b.load_failures {
            e.counter(
                "kvx:kv_load_failures_total",
                "Failed loads by cause (handshake, incompatible, transfer, timeout, peer_gone, verify, notify).",
                &bl_with(("cause", cause)),
                *n,
            );
        }
        e.counter("kvx:kv_blocks_read_total", "KV blocks read by this engine.", &bl, b.blocks_read);
        e.counter("kvx:kv_bytes_read_total", "KV bytes read by this engine.", &bl, b.bytes_read);
        e.counter(
            "kvx:kv_bytes_verified_total",
            "KV bytes read and checked against the pattern the prefill engine wrote.",
            &bl,
            b.bytes_verified,
        );
        e.counter(
            "kvx:kv_verify_failures_total",
            "Decode ranks whose read bytes differed from what the prefill engine wrote.",
            &bl,
            b.verify_failures,
        );
        e.counter(
            "kvx:kv_handshakes_total",
            "Side-channel handshakes with prefill engines (per decode rank).",
            &bl,
            b.handshakes,
        );
        e.gauge(
            "kvx:kv_blocks_held",
            "KV blocks held for decode engines to read (prefill role).",
            &bl,
            b.blocks_held as f64,
        );
        e.gauge(
            "kvx:kv_blocks_in_use",
            "KV blocks allocated from this engine's pool.",
            &bl,
            b.blocks_in_use as f64,
        );
        e.gauge("kvx:kv_backlog", "Requests waiting for free KV blocks.", &bl, b.backlog as f64);
        e.counter(
            "kvx:kv_leases_expired_total",
            "Held blocks released because no decode engine read them in time (per rank).",
            &bl,
            b.leases_expired,
        );
        e.counter(
            "kvx:kv_notifications_unrecognized_total",
            "Notifications for requests no prefill rank held, or not in vLLM's format (per rank).",
            &bl,
            b.unrecognized_notifs,
        );
        e.counter("kvx:kv_aborts_total", "Requests the backend was told to abort.", &bl, b.aborts);
    }
}
