//! The names of every environment variable kvx reads, with their meaning. Reading them is
//! `settings::env`'s (and, for UCX's own variables, the UCX binding's).

/// Path of the `libucp.so` to load (same as `--ucx-lib`).
pub const KVX_UCX_LIB: &str = "KVX_UCX_LIB";
/// Root of a UCX install to prefer over the system's (holds `libucx/lib/libucp.so.0` or
/// `lib/libucp.so.0`; `scripts/setup-ucx.sh` creates one as `.ucx/`).
pub const KVX_UCX_DIR: &str = "KVX_UCX_DIR";
/// Path of the `libnixl_capi.so` to load for `--transport nixl` (NIXL's C API from its wheel).
pub const KVX_NIXL_LIB: &str = "KVX_NIXL_LIB";
/// Root of an unpacked NIXL wheel (holds `.nixl_cu12.mesonpy.libs/libnixl_capi.so`;
/// `scripts/setup-nixl.sh` creates one as `.nixl/`).
pub const KVX_NIXL_DIR: &str = "KVX_NIXL_DIR";
/// Directory runs are written under (default `results/`).
pub const KVX_RESULTS_DIR: &str = "KVX_RESULTS_DIR";
/// tracing filter for kvx's logs on stderr (e.g. `kvx=debug`).
pub const KVX_LOG: &str = "KVX_LOG";

/// Directory of the vLLM oracle vectors the tests read (tests only; default
/// `../shared/oracle` beside the project root).
pub const KVX_ORACLE_DIR: &str = "KVX_ORACLE_DIR";
/// Bearer token `kvx serve-proxy` sends to the engines (same as `--backend-api-key`; the
/// variable vLLM's toy proxy reads, so its scripts work unchanged).
pub const OPENAI_API_KEY: &str = "OPENAI_API_KEY";

/// All documented variables with their one-line meaning (printed by `kvx doctor`).
pub const ALL: &[(&str, &str)] = &[
    (KVX_UCX_LIB, "path of the libucp.so to load (same as --ucx-lib)"),
    (KVX_UCX_DIR, "root of a UCX install preferred over the system's (default: .ucx/ of the project)"),
    (KVX_NIXL_LIB, "path of the libnixl_capi.so to load for --transport nixl"),
    (KVX_NIXL_DIR, "root of an unpacked NIXL wheel (default: .nixl/ of the project)"),
    (KVX_RESULTS_DIR, "directory runs are written under (default results/)"),
    (KVX_LOG, "log filter for stderr, e.g. kvx=debug"),
    (KVX_ORACLE_DIR, "tests only: directory of the vLLM oracle vectors (default ../shared/oracle)"),
    (OPENAI_API_KEY, "bearer token serve-proxy sends to engines (same as --backend-api-key)"),
];
