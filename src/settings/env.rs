//! Every environment variable kvx reads, in one place. Precedence everywhere:
//! defaults < config file < environment < flags.

/// Path of the `libucp.so` to load (same as `--ucx-lib`).
pub const KVX_UCX_LIB: &str = "KVX_UCX_LIB";
/// Directory runs are written under (default `results/`).
pub const KVX_RESULTS_DIR: &str = "KVX_RESULTS_DIR";
/// tracing filter for kvx's logs on stderr (e.g. `kvx=debug`).
pub const KVX_LOG: &str = "KVX_LOG";

/// Bearer token `kvx serve-proxy` sends to the engines (same as `--backend-api-key`; the
/// variable vLLM's toy proxy reads, so its scripts work unchanged).
pub const OPENAI_API_KEY: &str = "OPENAI_API_KEY";

/// All documented variables with their one-line meaning (printed by `kvx doctor`).
pub const ALL: &[(&str, &str)] = &[
    (KVX_UCX_LIB, "path of the libucp.so to load (same as --ucx-lib)"),
    (KVX_RESULTS_DIR, "directory runs are written under (default results/)"),
    (KVX_LOG, "log filter for stderr, e.g. kvx=debug"),
    (OPENAI_API_KEY, "bearer token serve-proxy sends to engines (same as --backend-api-key)"),
];
