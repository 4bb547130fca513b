//! Hand-written declarations of the part of NIXL's C API (`libnixl_capi.so`, NIXL 1.5.1's
//! `src/bindings/rust/wrapper.h`) kvx calls.
//!
//! Owns: the handle types, status and enum values, the agent configuration struct, the
//! telemetry struct and the table [`Api`] resolved from a library loaded at run time. Must
//! not contain logic: `agent` decides how these are called. The signatures were checked
//! against the 1.5.1 wheel's exports (descriptor lists take no `sorted` flag since 1.3).

use std::ffi::{c_char, c_int, c_void};

use libloading::os::unix::Library;

/// `nixl_capi_status_t`.
pub type Status = c_int;
pub const SUCCESS: Status = 0;
pub const IN_PROG: Status = 1;
/// In progress, and at least one entry already failed (newer releases).
pub const IN_PROG_WITH_ERR: Status = 2;
pub const ERROR_INVALID_PARAM: Status = -1;
pub const ERROR_BACKEND: Status = -2;
pub const ERROR_INVALID_STATE: Status = -3;
pub const ERROR_EXCEPTION: Status = -4;
pub const ERROR_NO_TELEMETRY: Status = -5;
pub const ERROR_NOT_SUPPORTED: Status = -6;

/// The name of a status code, for errors.
pub fn status_name(s: Status) -> &'static str {
    match s {
        SUCCESS => "NIXL_CAPI_SUCCESS",
        IN_PROG => "NIXL_CAPI_IN_PROG",
        IN_PROG_WITH_ERR => "NIXL_CAPI_IN_PROG_WITH_ERR",
        ERROR_INVALID_PARAM => "NIXL_CAPI_ERROR_INVALID_PARAM",
        ERROR_BACKEND => "NIXL_CAPI_ERROR_BACKEND",
        ERROR_INVALID_STATE => "NIXL_CAPI_ERROR_INVALID_STATE",
        ERROR_EXCEPTION => "NIXL_CAPI_ERROR_EXCEPTION",
        ERROR_NO_TELEMETRY => "NIXL_CAPI_ERROR_NO_TELEMETRY",
        ERROR_NOT_SUPPORTED => "NIXL_CAPI_ERROR_NOT_SUPPORTED",
        _ => "unknown NIXL status",
    }
}

/// `nixl_capi_mem_type_t`.
pub type MemType = c_int;
pub const MEM_DRAM: MemType = 0;
pub const MEM_VRAM: MemType = 1;

/// `nixl_capi_xfer_op_t`.
pub type XferOp = c_int;
pub const XFER_OP_READ: XferOp = 0;
pub const XFER_OP_WRITE: XferOp = 1;

/// `nixl_capi_thread_sync_t`.
pub type ThreadSync = c_int;
pub const THREAD_SYNC_NONE: ThreadSync = 0;

pub type AgentH = *mut c_void;
pub type ParamsH = *mut c_void;
pub type MemListH = *mut c_void;
pub type StringListH = *mut c_void;
pub type BackendH = *mut c_void;
pub type OptArgsH = *mut c_void;
pub type ParamIterH = *mut c_void;
pub type XferDlistH = *mut c_void;
pub type XferDlistHandleH = *mut c_void;
pub type RegDlistH = *mut c_void;
pub type XferReqH = *mut c_void;
pub type NotifMapH = *mut c_void;

/// `nixl_capi_agent_config_t` (mirrors `nixlAgentConfig`'s constructor arguments).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    pub thread_sync: ThreadSync,
    pub num_workers: u32,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// `struct nixl_capi_xfer_telemetry_s`: one request's timings as NIXL measured them.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XferTelemetry {
    pub start_time_us: u64,
    pub post_duration_us: u64,
    pub xfer_duration_us: u64,
    pub total_bytes: u64,
    pub desc_count: u64,
}

macro_rules! api_table {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// Function pointers resolved from one loaded `libnixl_capi.so`.
        pub struct Api {
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            /// Keeps the library mapped for as long as the pointers above are used.
            _lib: Library,
        }

        impl Api {
            /// Resolves every symbol kvx uses. `Err` names the first one missing.
            ///
            /// # Safety
            /// `lib` must be NIXL's C API library whose symbols have the signatures declared here.
            pub unsafe fn resolve(lib: Library) -> Result<Self, &'static str> {
                $(
                    // SAFETY: the caller guarantees the symbol has this signature; the
                    // pointer stays valid because `lib` is moved into the returned table.
                    let $name = unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0"),
                        )
                        .map_err(|_| stringify!($name))?
                    };
                )*
                Ok(Self { $($name,)* _lib: lib })
            }
        }
    };
}

api_table! {
    nixl_capi_is_stub: fn() -> bool;
    nixl_capi_create_configured_agent: fn(*const c_char, *const AgentConfig, *mut AgentH) -> Status;
    nixl_capi_destroy_agent: fn(AgentH) -> Status;
    nixl_capi_get_local_md: fn(AgentH, *mut *mut c_void, *mut usize) -> Status;
    nixl_capi_load_remote_md: fn(AgentH, *const c_void, usize, *mut *mut c_char) -> Status;
    nixl_capi_invalidate_remote_md: fn(AgentH, *const c_char) -> Status;
    nixl_capi_get_available_plugins: fn(AgentH, *mut StringListH) -> Status;
    nixl_capi_destroy_string_list: fn(StringListH) -> Status;
    nixl_capi_string_list_size: fn(StringListH, *mut usize) -> Status;
    nixl_capi_string_list_get: fn(StringListH, usize, *mut *const c_char) -> Status;
    nixl_capi_get_plugin_params: fn(AgentH, *const c_char, *mut MemListH, *mut ParamsH) -> Status;
    nixl_capi_destroy_mem_list: fn(MemListH) -> Status;
    nixl_capi_destroy_params: fn(ParamsH) -> Status;
    nixl_capi_params_add: fn(ParamsH, *const c_char, *const c_char) -> Status;
    nixl_capi_params_is_empty: fn(ParamsH, *mut bool) -> Status;
    nixl_capi_params_create_iterator: fn(ParamsH, *mut ParamIterH) -> Status;
    nixl_capi_params_iterator_next: fn(ParamIterH, *mut *const c_char, *mut *const c_char, *mut bool) -> Status;
    nixl_capi_params_destroy_iterator: fn(ParamIterH) -> Status;
    nixl_capi_mem_list_size: fn(MemListH, *mut usize) -> Status;
    nixl_capi_mem_list_get: fn(MemListH, usize, *mut MemType) -> Status;
    nixl_capi_create_backend: fn(AgentH, *const c_char, ParamsH, *mut BackendH) -> Status;
    nixl_capi_destroy_backend: fn(BackendH) -> Status;
    nixl_capi_get_backend_params: fn(AgentH, BackendH, *mut MemListH, *mut ParamsH) -> Status;
    nixl_capi_create_opt_args: fn(*mut OptArgsH) -> Status;
    nixl_capi_destroy_opt_args: fn(OptArgsH) -> Status;
    nixl_capi_opt_args_add_backend: fn(OptArgsH, BackendH) -> Status;
    nixl_capi_opt_args_set_notif_msg: fn(OptArgsH, *const c_void, usize) -> Status;
    nixl_capi_opt_args_set_has_notif: fn(OptArgsH, bool) -> Status;
    nixl_capi_opt_args_set_skip_desc_merge: fn(OptArgsH, bool) -> Status;
    nixl_capi_register_mem: fn(AgentH, RegDlistH, OptArgsH) -> Status;
    nixl_capi_deregister_mem: fn(AgentH, RegDlistH, OptArgsH) -> Status;
    nixl_capi_prep_xfer_dlist: fn(AgentH, *const c_char, XferDlistH, *mut XferDlistHandleH, OptArgsH) -> Status;
    nixl_capi_release_xfer_dlist_handle: fn(AgentH, XferDlistHandleH) -> Status;
    nixl_capi_make_xfer_req: fn(
        AgentH, XferOp, XferDlistHandleH, *const c_int, usize, XferDlistHandleH, *const c_int, usize,
        *mut XferReqH, OptArgsH
    ) -> Status;
    nixl_capi_post_xfer_req: fn(AgentH, XferReqH, OptArgsH) -> Status;
    nixl_capi_get_xfer_status: fn(AgentH, XferReqH) -> Status;
    nixl_capi_get_xfer_telemetry: fn(AgentH, XferReqH, *mut XferTelemetry) -> Status;
    nixl_capi_release_xfer_req: fn(AgentH, XferReqH) -> Status;
    nixl_capi_destroy_xfer_req: fn(XferReqH) -> Status;
    nixl_capi_get_notifs: fn(AgentH, NotifMapH, OptArgsH) -> Status;
    nixl_capi_create_notif_map: fn(*mut NotifMapH) -> Status;
    nixl_capi_destroy_notif_map: fn(NotifMapH) -> Status;
    nixl_capi_notif_map_size: fn(NotifMapH, *mut usize) -> Status;
    nixl_capi_notif_map_get_agent_at: fn(NotifMapH, usize, *mut *const c_char) -> Status;
    nixl_capi_notif_map_get_notifs_size: fn(NotifMapH, *const c_char, *mut usize) -> Status;
    nixl_capi_notif_map_get_notif: fn(NotifMapH, *const c_char, usize, *mut *const c_void, *mut usize) -> Status;
    nixl_capi_gen_notif: fn(AgentH, *const c_char, *const c_void, usize, OptArgsH) -> Status;
    nixl_capi_create_xfer_dlist: fn(MemType, *mut XferDlistH) -> Status;
    nixl_capi_destroy_xfer_dlist: fn(XferDlistH) -> Status;
    nixl_capi_xfer_dlist_add_desc: fn(XferDlistH, usize, usize, u64) -> Status;
    nixl_capi_create_reg_dlist: fn(MemType, *mut RegDlistH) -> Status;
    nixl_capi_destroy_reg_dlist: fn(RegDlistH) -> Status;
    nixl_capi_reg_dlist_add_desc: fn(RegDlistH, usize, usize, u64, *const c_void, usize) -> Status;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_and_telemetry_structs_have_the_c_layout() {
        // wrapper.h: bool, bool, int (at 4), enum (8), unsigned (12), uint64 (16, 24), bool (32).
        assert_eq!(std::mem::offset_of!(AgentConfig, listen_port), 4);
        assert_eq!(std::mem::offset_of!(AgentConfig, thread_sync), 8);
        assert_eq!(std::mem::offset_of!(AgentConfig, num_workers), 12);
        assert_eq!(std::mem::offset_of!(AgentConfig, pthr_delay_us), 16);
        assert_eq!(std::mem::offset_of!(AgentConfig, lthr_delay_us), 24);
        assert_eq!(std::mem::offset_of!(AgentConfig, capture_telemetry), 32);
        assert_eq!(std::mem::size_of::<AgentConfig>(), 40);
        assert_eq!(std::mem::size_of::<XferTelemetry>(), 40);
    }
}
