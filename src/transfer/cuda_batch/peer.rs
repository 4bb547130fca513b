//! Whether a peer's CUDA IPC export can be opened in this process, decided before CUDA is
//! asked: this machine's identity ([`machine_id`]), and the refusals of [`check_export`] (none
//! advertised, another machine, this very process, a handle of the wrong size). Pure: no CUDA.

use super::error::CudaBatchError;
use crate::transfer::handshake::meta::CudaIpcExport;

/// This machine's identity for "are we on one machine": the kernel's boot id (one per booted
/// kernel, shared by every container on it), else the host name.
pub fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(hostname)
        .unwrap_or_else(|| "unknown".into())
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|s| s.trim().to_string())
}

/// Refuses a peer export this process cannot open, before CUDA is asked: none advertised,
/// another machine, this very process, a handle of the wrong size.
pub fn check_export<'a>(
    peer: &str,
    export: Option<&'a CudaIpcExport>,
) -> Result<&'a CudaIpcExport, CudaBatchError> {
    let e = export.ok_or_else(|| CudaBatchError::NoExport { peer: peer.to_string() })?;
    let ours = machine_id();
    if e.machine_id != ours {
        return Err(CudaBatchError::OtherMachine {
            peer: peer.to_string(),
            theirs: e.machine_id.clone(),
            ours,
        });
    }
    if e.pid == std::process::id() {
        return Err(CudaBatchError::SameProcess { peer: peer.to_string() });
    }
    if e.handle.len() != IPC_HANDLE_BYTES {
        return Err(CudaBatchError::BadHandle { peer: peer.to_string(), len: e.handle.len() });
    }
    Ok(e)
}

/// Size of a `CUipcMemHandle`.
pub const IPC_HANDLE_BYTES: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn export(machine: &str, pid: u32, handle: usize) -> CudaIpcExport {
        CudaIpcExport {
            handle: vec![7; handle],
            base_addr: 0x1000,
            len: 4096,
            device: 0,
            machine_id: machine.into(),
            pid,
        }
    }

    #[test]
    fn exports_that_cannot_be_opened_here_are_refused_before_cuda() {
        let here = machine_id();
        assert!(!here.is_empty());
        let other_pid = std::process::id().wrapping_add(1);
        assert!(check_export("prefill rank 0", Some(&export(&here, other_pid, 64))).is_ok());
        let e = check_export("prefill rank 0", None).expect_err("none");
        assert!(e.to_string().contains("--transport cuda-batch"), "{e}");
        let e =
            check_export("prefill rank 1", Some(&export("elsewhere", other_pid, 64))).expect_err("machine");
        assert!(
            matches!(e, CudaBatchError::OtherMachine { .. }) && e.to_string().contains("--transport ucx")
        );
        let e = check_export("p", Some(&export(&here, std::process::id(), 64))).expect_err("same process");
        assert!(matches!(e, CudaBatchError::SameProcess { .. }), "{e}");
        let e = check_export("p", Some(&export(&here, other_pid, 63))).expect_err("short handle");
        assert_eq!(e, CudaBatchError::BadHandle { peer: "p".into(), len: 63 });
    }
}
