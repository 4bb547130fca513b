//! Flags shared by several subcommands: the model shape, the P/D engine pair, the ports and
//! the output format (defined with their settings, `settings::flags`); and how `kvx topo`,
//! `layout` and `plan` refuse a request ([`reject`]).

use crate::error::ConfigError;
use crate::layouts::request::PlanError;
use crate::output;
pub use crate::settings::flags::{Format, ModelFlags, PairFlags, PortFlags};

/// A refused request: the setting to change, and whether vLLM itself refuses it (a hybrid
/// pair its handshake would turn away), which the JSON view says.
#[derive(Debug)]
pub struct Rejection {
    pub error: ConfigError,
    pub by_vllm: bool,
}

impl From<ConfigError> for Rejection {
    fn from(error: ConfigError) -> Self {
        Rejection { error, by_vllm: false }
    }
}

impl From<PlanError> for Rejection {
    fn from(e: PlanError) -> Self {
        let by_vllm = e.refused_by_vllm();
        Rejection { error: crate::settings::plan::plan_error(e), by_vllm }
    }
}

/// Prints a rejection in the requested format (JSON: one `{"status": "rejected"}` line on
/// stdout); the caller returns the error, which exits 2.
pub fn reject(format: Format, rejection: impl Into<Rejection>) -> anyhow::Error {
    let Rejection { error, by_vllm } = rejection.into();
    if format == Format::Json {
        let body = if by_vllm {
            // vLLM's own refusal, as the oracle records it.
            serde_json::json!({"status": "rejected", "by": "vllm", "error": error.to_string(), "flag": error.flag})
        } else {
            serde_json::json!({"status": "rejected", "error": error.to_string(), "flag": error.flag})
        };
        // The rejection is the error either way; a closed stdout changes nothing.
        let _ = output::stdout_line(body);
    }
    error.into()
}
