//! Hand-written declarations of the part of the UCP C API kvx uses (UCP API 1.13, which
//! later releases extend only by appending fields and enum values).
//!
//! Owns: `#[repr(C)]` mirrors of the parameter structs, the constants kvx sets, the
//! function pointer types and the table [`Api`] resolved from a `libucp` loaded at run
//! time. Must not contain logic: the safe layer in the sibling modules decides how these
//! are called. A test (`tests/it/ucx_layout.rs`) compiles a C probe against the installed
//! headers and checks every size and offset declared here.
//!
//! UCX's ABI contract is the `field_mask`: the library reads only the fields whose bit is
//! set, so structs are always zero-initialised ([`zeroed`]) and masks set explicitly.

use std::ffi::{c_char, c_int, c_uint, c_void};

use libloading::os::unix::Library;

/// `ucs_status_t` is a packed enum in C (`UCS_S_PACKED`): one signed byte.
pub type UcsStatus = i8;
/// `ucs_status_ptr_t`: NULL, an error code cast to a pointer, or a request.
pub type UcsStatusPtr = *mut c_void;

pub type UcpContextH = *mut c_void;
pub type UcpConfigH = *mut c_void;
pub type UcpWorkerH = *mut c_void;
pub type UcpEpH = *mut c_void;
pub type UcpMemH = *mut c_void;
pub type UcpRkeyH = *mut c_void;
pub type UcpAddress = c_void;
/// C `FILE *`, only ever passed through to UCX's print functions.
pub type CFile = libc::FILE;

pub const UCS_OK: UcsStatus = 0;
pub const UCS_INPROGRESS: UcsStatus = 1;
pub const UCS_ERR_NO_RESOURCE: UcsStatus = -2;
pub const UCS_ERR_BUSY: UcsStatus = -15;
pub const UCS_ERR_CANCELED: UcsStatus = -16;
pub const UCS_ERR_TIMED_OUT: UcsStatus = -20;
pub const UCS_ERR_UNSUPPORTED: UcsStatus = -22;
pub const UCS_ERR_LAST: isize = -100;

// ucp_params_t field mask and features.
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// ucp_worker_params_t.
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;

// ucp_ep_params_t.
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ucp_mem_map_params_t.
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;

// ucp_mem_attr_t.
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

// ucp_context_attr_t.
pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;

// ucp_request_param_t op_attr_mask.
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;

// Active messages: ucp_am_handler_param_t field mask, handler flags, send flags and
// the receive attributes UCX passes to the handler.
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

// ucs_memory_type_t values kvx registers (stable across 1.13..1.23).
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub const UCS_MEMORY_TYPE_CUDA: c_int = 1;

/// `ucs_cpu_set_t`: 1024 bits inline.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UcsCpuSet {
    pub bits: [u64; 16],
}

/// `ucp_request_init_callback_t` / `ucp_request_cleanup_callback_t`.
pub type RequestHook = Option<unsafe extern "C" fn(request: *mut c_void)>;
/// `ucp_send_nbx_callback_t`.
pub type SendNbxCallback =
    Option<unsafe extern "C" fn(request: *mut c_void, status: UcsStatus, user_data: *mut c_void)>;
/// `ucp_err_handler_cb_t`.
pub type ErrHandlerCb = Option<unsafe extern "C" fn(arg: *mut c_void, ep: UcpEpH, status: UcsStatus)>;

/// `ucp_am_recv_callback_t`: runs inside `ucp_worker_progress` for every active message
/// with the handler's id.
pub type AmRecvCallback = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        data: *mut c_void,
        length: usize,
        param: *const UcpAmRecvParam,
    ) -> UcsStatus,
>;

/// `ucp_params_t`.
#[repr(C)]
pub struct UcpParams {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: RequestHook,
    pub request_cleanup: RequestHook,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t`.
#[repr(C)]
pub struct UcpWorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: UcsCpuSet,
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct UcpErrHandler {
    pub cb: ErrHandlerCb,
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct UcsSockAddr {
    pub addr: *const c_void,
    pub addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub struct UcpEpParams {
    pub field_mask: u64,
    pub address: *const UcpAddress,
    pub err_mode: c_int,
    pub err_handler: UcpErrHandler,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: UcsSockAddr,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: UcsSockAddr,
}

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub struct UcpMemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_mem_attr_t`.
#[repr(C)]
pub struct UcpMemAttr {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: c_int,
}

/// `ucp_context_attr_t`.
#[repr(C)]
pub struct UcpContextAttr {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: c_int,
    pub memory_types: u64,
    pub name: [c_char; 32],
}

/// `ucp_request_param_t`. `cb` and `recv_info` are unions of pointers in C; kvx only
/// ever stores the send callback and nothing in `recv_info`.
#[repr(C)]
pub struct UcpRequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: SendNbxCallback,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: UcpMemH,
}

/// `ucp_am_handler_param_t`.
#[repr(C)]
pub struct UcpAmHandlerParam {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: AmRecvCallback,
    pub arg: *mut c_void,
}

/// `ucp_am_recv_param_t` (`struct ucp_am_recv_param`): `recv_attr` holds both the field
/// mask and the `UCP_AM_RECV_ATTR_FLAG_*` bits.
#[repr(C)]
pub struct UcpAmRecvParam {
    pub recv_attr: u64,
    pub reply_ep: UcpEpH,
}

/// An all-zero value of one of the plain-old-data structs above, the state UCX expects
/// before a caller sets `field_mask` and the fields it names.
pub fn zeroed<T: Zeroable>() -> T {
    // SAFETY: `Zeroable` is only implemented for the `#[repr(C)]` structs of this module,
    // whose fields are integers, raw pointers and `Option<fn>`, for all of which the
    // all-zero bit pattern is a valid value (0, null, None).
    unsafe { std::mem::zeroed() }
}

/// Marker for structs whose all-zero bit pattern is valid (see [`zeroed`]).
pub trait Zeroable {}
impl Zeroable for UcpParams {}
impl Zeroable for UcpWorkerParams {}
impl Zeroable for UcpEpParams {}
impl Zeroable for UcpMemMapParams {}
impl Zeroable for UcpMemAttr {}
impl Zeroable for UcpContextAttr {}
impl Zeroable for UcpRequestParam {}
impl Zeroable for UcpAmHandlerParam {}

/// `UCS_PTR_IS_ERR`.
#[inline(always)]
pub fn ptr_is_err(p: UcsStatusPtr) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// `UCS_PTR_IS_PTR`.
#[inline(always)]
pub fn ptr_is_ptr(p: UcsStatusPtr) -> bool {
    (p as usize).wrapping_sub(1) < (UCS_ERR_LAST as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, else the status the pointer encodes.
#[inline(always)]
pub fn ptr_status(p: UcsStatusPtr) -> UcsStatus {
    if ptr_is_ptr(p) { UCS_INPROGRESS } else { p as isize as UcsStatus }
}

macro_rules! api_table {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// Function pointers resolved from one loaded `libucp` (and its `libucs`).
        pub struct Api {
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            /// Keeps the library mapped for as long as the pointers above are used.
            _lib: Library,
        }

        impl Api {
            /// Resolves every symbol kvx uses. `Err` names the first one missing.
            ///
            /// # Safety
            /// `lib` must be a UCX `libucp` whose symbols have the C signatures declared here.
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
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucp_get_version_string: fn() -> *const c_char;
    ucp_config_read: fn(*const c_char, *const c_char, *mut UcpConfigH) -> UcsStatus;
    ucp_config_modify: fn(UcpConfigH, *const c_char, *const c_char) -> UcsStatus;
    ucp_config_release: fn(UcpConfigH);
    ucp_init_version: fn(c_uint, c_uint, *const UcpParams, UcpConfigH, *mut UcpContextH) -> UcsStatus;
    ucp_cleanup: fn(UcpContextH);
    ucp_context_query: fn(UcpContextH, *mut UcpContextAttr) -> UcsStatus;
    ucp_context_print_info: fn(UcpContextH, *mut CFile);
    ucp_worker_create: fn(UcpContextH, *const UcpWorkerParams, *mut UcpWorkerH) -> UcsStatus;
    ucp_worker_destroy: fn(UcpWorkerH);
    ucp_worker_print_info: fn(UcpWorkerH, *mut CFile);
    ucp_worker_get_address: fn(UcpWorkerH, *mut *mut UcpAddress, *mut usize) -> UcsStatus;
    ucp_worker_release_address: fn(UcpWorkerH, *mut UcpAddress);
    ucp_worker_progress: fn(UcpWorkerH) -> c_uint;
    ucp_worker_get_efd: fn(UcpWorkerH, *mut c_int) -> UcsStatus;
    ucp_worker_arm: fn(UcpWorkerH) -> UcsStatus;
    ucp_ep_create: fn(UcpWorkerH, *const UcpEpParams, *mut UcpEpH) -> UcsStatus;
    ucp_ep_close_nbx: fn(UcpEpH, *const UcpRequestParam) -> UcsStatusPtr;
    ucp_ep_print_info: fn(UcpEpH, *mut CFile);
    ucp_ep_flush_nbx: fn(UcpEpH, *const UcpRequestParam) -> UcsStatusPtr;
    ucp_mem_map: fn(UcpContextH, *const UcpMemMapParams, *mut UcpMemH) -> UcsStatus;
    ucp_mem_unmap: fn(UcpContextH, UcpMemH) -> UcsStatus;
    ucp_mem_query: fn(UcpMemH, *mut UcpMemAttr) -> UcsStatus;
    ucp_rkey_pack: fn(UcpContextH, UcpMemH, *mut *mut c_void, *mut usize) -> UcsStatus;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(UcpEpH, *const c_void, *mut UcpRkeyH) -> UcsStatus;
    ucp_rkey_destroy: fn(UcpRkeyH);
    ucp_get_nbx: fn(UcpEpH, *mut c_void, usize, u64, UcpRkeyH, *const UcpRequestParam) -> UcsStatusPtr;
    ucp_put_nbx: fn(UcpEpH, *const c_void, usize, u64, UcpRkeyH, *const UcpRequestParam) -> UcsStatusPtr;
    ucp_worker_set_am_recv_handler: fn(UcpWorkerH, *const UcpAmHandlerParam) -> UcsStatus;
    ucp_am_send_nbx: fn(UcpEpH, c_uint, *const c_void, usize, *const c_void, usize, *const UcpRequestParam) -> UcsStatusPtr;
    ucp_request_check_status: fn(*mut c_void) -> UcsStatus;
    ucp_request_free: fn(*mut c_void);
    ucs_status_string: fn(UcsStatus) -> *const c_char;
}

/// Symbolic name of a status code (the `UCS_*` enumerator), for error messages.
pub fn status_name(code: UcsStatus) -> &'static str {
    match code {
        0 => "UCS_OK",
        1 => "UCS_INPROGRESS",
        -1 => "UCS_ERR_NO_MESSAGE",
        -2 => "UCS_ERR_NO_RESOURCE",
        -3 => "UCS_ERR_IO_ERROR",
        -4 => "UCS_ERR_NO_MEMORY",
        -5 => "UCS_ERR_INVALID_PARAM",
        -6 => "UCS_ERR_UNREACHABLE",
        -7 => "UCS_ERR_INVALID_ADDR",
        -8 => "UCS_ERR_NOT_IMPLEMENTED",
        -9 => "UCS_ERR_MESSAGE_TRUNCATED",
        -10 => "UCS_ERR_NO_PROGRESS",
        -11 => "UCS_ERR_BUFFER_TOO_SMALL",
        -12 => "UCS_ERR_NO_ELEM",
        -13 => "UCS_ERR_SOME_CONNECTS_FAILED",
        -14 => "UCS_ERR_NO_DEVICE",
        -15 => "UCS_ERR_BUSY",
        -16 => "UCS_ERR_CANCELED",
        -17 => "UCS_ERR_SHMEM_SEGMENT",
        -18 => "UCS_ERR_ALREADY_EXISTS",
        -19 => "UCS_ERR_OUT_OF_RANGE",
        -20 => "UCS_ERR_TIMED_OUT",
        -21 => "UCS_ERR_EXCEEDS_LIMIT",
        -22 => "UCS_ERR_UNSUPPORTED",
        -23 => "UCS_ERR_REJECTED",
        -24 => "UCS_ERR_NOT_CONNECTED",
        -25 => "UCS_ERR_CONNECTION_RESET",
        -80 => "UCS_ERR_ENDPOINT_TIMEOUT",
        -59..=-40 => "UCS_ERR_LINK_FAILURE",
        -89..=-60 => "UCS_ERR_ENDPOINT_FAILURE",
        _ => "UCS_ERR_UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_pointer_macros_match_the_header_definitions() {
        let null = std::ptr::null_mut::<c_void>();
        assert!(!ptr_is_err(null) && !ptr_is_ptr(null));
        assert_eq!(ptr_status(null), UCS_OK);
        let err = (-3isize) as usize as UcsStatusPtr;
        assert!(ptr_is_err(err) && !ptr_is_ptr(err));
        assert_eq!(ptr_status(err), -3);
        let last = UCS_ERR_LAST as usize as UcsStatusPtr;
        assert!(ptr_is_err(last));
        let req = 0x7f00_1234_5670usize as UcsStatusPtr;
        assert!(ptr_is_ptr(req) && !ptr_is_err(req));
        assert_eq!(ptr_status(req), UCS_INPROGRESS);
        // one past UCS_ERR_LAST is not an error code but a (strange) pointer
        let below = (UCS_ERR_LAST - 1) as usize as UcsStatusPtr;
        assert!(!ptr_is_err(below) && ptr_is_ptr(below));
    }

    #[test]
    fn status_names_cover_the_failure_ranges() {
        assert_eq!(status_name(-25), "UCS_ERR_CONNECTION_RESET");
        assert_eq!(status_name(-45), "UCS_ERR_LINK_FAILURE");
        assert_eq!(status_name(-80), "UCS_ERR_ENDPOINT_TIMEOUT");
        assert_eq!(status_name(-99), "UCS_ERR_UNKNOWN");
    }
}
