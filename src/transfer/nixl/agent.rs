//! The safe layer over NIXL's C API: an agent with one backend, registered regions,
//! prepared descriptor lists, transfer requests and notifications.
//!
//! Ownership mirrors NIXL's: every handle made from an agent holds the agent (an `Arc`), so
//! regions are deregistered, prepared lists and requests released before the agent is
//! destroyed, whatever order the caller drops them in. A region owns its memory and gives it
//! back only after NIXL has deregistered it. An agent is used by one thread at a time
//! (NIXL's `THREAD_SYNC_NONE`, as vLLM creates it): it is `Send`, not `Sync`.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use super::NixlError;
use super::library::Nixl;
use super::sys::{self, AgentH, BackendH, OptArgsH, Status, XferReqH};
use crate::transfer::ucx::{ErrMode, MemType, Registrable};

/// The agent name NIXL reads as "this agent's own memory, as the initiator" when preparing a
/// local list (NIXL's `NIXL_INIT_AGENT`, the empty string; vLLM writes "NIXL_INIT_AGENT",
/// which the Python API maps to it).
const NIXL_INIT_AGENT: &str = "";

/// How an agent is created (NIXL's `nixl_agent_config` and the backend's init parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentOptions {
    /// NIXL's progress thread (vLLM: on, the Python API's default).
    pub progress_thread: bool,
    /// Per-request telemetry (vLLM: on).
    pub telemetry: bool,
    /// UCX backend worker threads (`num_threads`; 0: NIXL's default).
    pub num_threads: u32,
    /// The backend plugin (vLLM's default: `UCX`).
    pub backend: String,
    /// The UCX backend's `ucx_error_handling_mode` (NIXL's default and vLLM's: peer).
    pub err_mode: ErrMode,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            progress_thread: true,
            telemetry: true,
            num_threads: 0,
            backend: "UCX".into(),
            err_mode: ErrMode::Peer,
        }
    }
}

struct Inner {
    nixl: Nixl,
    h: AgentH,
    backend: BackendH,
    name: String,
}

// SAFETY: NIXL agents may be used from any thread as long as calls do not overlap; `Agent`
// is not `Sync`, so only one thread holds it at a time, and the handles derived from it
// (which share `Inner`) are used on that same thread by construction of the pipeline.
unsafe impl Send for Inner {}
// SAFETY: `Inner` is only shared between handles of one agent, which its users keep on one
// thread; it has no interior mutability of its own.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        let api = self.nixl.api();
        // SAFETY: the backend and agent were created by this agent; every handle derived from
        // them holds this `Inner`, so none is alive any more.
        unsafe {
            (api.nixl_capi_destroy_backend)(self.backend);
            (api.nixl_capi_destroy_agent)(self.h);
        }
    }
}

/// One NIXL agent with one backend.
pub struct Agent {
    inner: Arc<Inner>,
    /// Not `Sync`: one thread at a time.
    _not_sync: PhantomData<Cell<()>>,
}

/// Memory kinds NIXL registers, as kvx uses them.
fn seg(mem: MemType) -> sys::MemType {
    match mem {
        MemType::Host => sys::MEM_DRAM,
        MemType::Cuda => sys::MEM_VRAM,
    }
}

fn cstring(what: &'static str, s: &str) -> Result<CString, NixlError> {
    CString::new(s).map_err(|_| NixlError::Invalid(format!("{what} {s:?} contains a NUL byte")))
}

impl Inner {
    fn check(&self, op: &'static str, s: Status) -> Result<(), NixlError> {
        if s == sys::SUCCESS {
            Ok(())
        } else {
            Err(NixlError::Status { op, code: s, name: sys::status_name(s) })
        }
    }
}

/// Optional arguments, destroyed on drop.
struct OptArgs<'a> {
    inner: &'a Inner,
    h: OptArgsH,
}

impl<'a> OptArgs<'a> {
    fn new(inner: &'a Inner) -> Result<Self, NixlError> {
        let mut h: OptArgsH = std::ptr::null_mut();
        // SAFETY: writes one handle.
        inner.check("nixl_capi_create_opt_args", unsafe {
            (inner.nixl.api().nixl_capi_create_opt_args)(&mut h)
        })?;
        let args = OptArgs { inner, h };
        // SAFETY: both handles are live; NIXL copies the backend pointer into its list.
        inner.check("nixl_capi_opt_args_add_backend", unsafe {
            (inner.nixl.api().nixl_capi_opt_args_add_backend)(args.h, inner.backend)
        })?;
        Ok(args)
    }

    fn notif(self, msg: Option<&[u8]>) -> Result<Self, NixlError> {
        if let Some(m) = msg {
            let api = self.inner.nixl.api();
            // SAFETY: NIXL copies `len` bytes from `data` into the argument set.
            self.inner.check("nixl_capi_opt_args_set_notif_msg", unsafe {
                (api.nixl_capi_opt_args_set_notif_msg)(self.h, m.as_ptr().cast(), m.len())
            })?;
            // SAFETY: sets a flag on a live handle.
            self.inner.check("nixl_capi_opt_args_set_has_notif", unsafe {
                (api.nixl_capi_opt_args_set_has_notif)(self.h, true)
            })?;
        }
        Ok(self)
    }
}

impl Drop for OptArgs<'_> {
    fn drop(&mut self) {
        // SAFETY: created by nixl_capi_create_opt_args, destroyed once.
        unsafe { (self.inner.nixl.api().nixl_capi_destroy_opt_args)(self.h) };
    }
}

/// A string list or parameter map read out of NIXL.
fn read_string_list(inner: &Inner, list: sys::StringListH) -> Result<Vec<String>, NixlError> {
    let api = inner.nixl.api();
    let mut n = 0usize;
    // SAFETY: a live list; writes one size.
    inner.check("nixl_capi_string_list_size", unsafe { (api.nixl_capi_string_list_size)(list, &mut n) })?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `i` is in range; the string stays valid until the list is destroyed.
        inner.check("nixl_capi_string_list_get", unsafe {
            (api.nixl_capi_string_list_get)(list, i, &mut p)
        })?;
        if !p.is_null() {
            // SAFETY: non-null, NUL-terminated, alive until the list is destroyed (after this copy).
            out.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    Ok(out)
}

fn read_params(inner: &Inner, params: sys::ParamsH) -> Result<Vec<(String, String)>, NixlError> {
    let api = inner.nixl.api();
    let mut empty = true;
    // SAFETY: a live parameter map; writes one bool.
    inner
        .check("nixl_capi_params_is_empty", unsafe { (api.nixl_capi_params_is_empty)(params, &mut empty) })?;
    let mut out = Vec::new();
    if empty {
        return Ok(out);
    }
    let mut it: sys::ParamIterH = std::ptr::null_mut();
    // SAFETY: a live, non-empty map; writes one iterator handle.
    inner.check("nixl_capi_params_create_iterator", unsafe {
        (api.nixl_capi_params_create_iterator)(params, &mut it)
    })?;
    loop {
        let (mut k, mut v, mut more): (*const c_char, *const c_char, bool) =
            (std::ptr::null(), std::ptr::null(), false);
        // SAFETY: a live iterator; the strings stay valid while the map lives.
        let s = unsafe { (api.nixl_capi_params_iterator_next)(it, &mut k, &mut v, &mut more) };
        if s != sys::SUCCESS || k.is_null() || v.is_null() {
            break;
        }
        // SAFETY: non-null NUL-terminated strings owned by the map.
        let (k, v) = unsafe { (CStr::from_ptr(k), CStr::from_ptr(v)) };
        out.push((k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()));
        if !more {
            break;
        }
    }
    // SAFETY: the iterator was created above and is destroyed once.
    unsafe { (api.nixl_capi_params_destroy_iterator)(it) };
    Ok(out)
}

/// What NIXL says about a backend: its init parameters and the memory kinds it moves.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct BackendInfo {
    pub name: String,
    pub params: Vec<(String, String)>,
    /// `DRAM`, `VRAM`, ...
    pub mem_types: Vec<String>,
}

fn mem_type_name(t: sys::MemType) -> String {
    match t {
        0 => "DRAM".into(),
        1 => "VRAM".into(),
        2 => "BLOCK".into(),
        3 => "OBJECT".into(),
        4 => "FILE".into(),
        n => format!("mem type {n}"),
    }
}

impl Agent {
    /// Creates an agent named `name` and its backend.
    pub fn new(nixl: &Nixl, name: &str, opts: &AgentOptions) -> Result<Agent, NixlError> {
        let api = nixl.api();
        let cname = cstring("agent name", name)?;
        let cfg = sys::AgentConfig {
            enable_prog_thread: opts.progress_thread,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: sys::THREAD_SYNC_NONE,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: opts.telemetry,
        };
        let mut h: AgentH = std::ptr::null_mut();
        // SAFETY: `cname` and `cfg` outlive the call, which copies them; writes one handle.
        let s = unsafe { (api.nixl_capi_create_configured_agent)(cname.as_ptr(), &cfg, &mut h) };
        if s != sys::SUCCESS || h.is_null() {
            return Err(NixlError::Status {
                op: "nixl_capi_create_configured_agent",
                code: s,
                name: sys::status_name(s),
            });
        }
        let backend_name = cstring("backend", &opts.backend)?;
        let (mut mems, mut params): (sys::MemListH, sys::ParamsH) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live agent; writes two handles the caller destroys.
        let s =
            unsafe { (api.nixl_capi_get_plugin_params)(h, backend_name.as_ptr(), &mut mems, &mut params) };
        if s != sys::SUCCESS {
            // SAFETY: created above, destroyed once.
            unsafe { (api.nixl_capi_destroy_agent)(h) };
            return Err(NixlError::Backend {
                backend: opts.backend.clone(),
                reason: format!("no such plugin ({})", sys::status_name(s)),
            });
        }
        if opts.backend == "UCX" {
            let k = cstring("param", "ucx_error_handling_mode")?;
            let v = cstring("param", &opts.err_mode.to_string())?;
            // SAFETY: a live map; NIXL copies both strings (an existing key is replaced).
            unsafe { (api.nixl_capi_params_add)(params, k.as_ptr(), v.as_ptr()) };
        }
        if opts.num_threads > 0 {
            let k = cstring("param", "num_threads")?;
            let v = cstring("param", &opts.num_threads.to_string())?;
            // SAFETY: a live map; NIXL copies both strings.
            unsafe { (api.nixl_capi_params_add)(params, k.as_ptr(), v.as_ptr()) };
        }
        let mut backend: BackendH = std::ptr::null_mut();
        // SAFETY: live agent and parameter map; writes one handle.
        let s = unsafe { (api.nixl_capi_create_backend)(h, backend_name.as_ptr(), params, &mut backend) };
        // SAFETY: the lists were created by get_plugin_params and are destroyed once.
        unsafe {
            (api.nixl_capi_destroy_mem_list)(mems);
            (api.nixl_capi_destroy_params)(params);
        }
        if s != sys::SUCCESS || backend.is_null() {
            // SAFETY: created above, destroyed once.
            unsafe { (api.nixl_capi_destroy_agent)(h) };
            return Err(NixlError::Backend {
                backend: opts.backend.clone(),
                reason: sys::status_name(s).into(),
            });
        }
        Ok(Agent {
            inner: Arc::new(Inner { nixl: nixl.clone(), h, backend, name: name.to_owned() }),
            _not_sync: PhantomData,
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The plugins NIXL found beside its library.
    pub fn plugins(&self) -> Result<Vec<String>, NixlError> {
        let api = self.inner.nixl.api();
        let mut list: sys::StringListH = std::ptr::null_mut();
        // SAFETY: a live agent; writes one handle destroyed below.
        self.inner.check("nixl_capi_get_available_plugins", unsafe {
            (api.nixl_capi_get_available_plugins)(self.inner.h, &mut list)
        })?;
        let out = read_string_list(&self.inner, list);
        // SAFETY: created above, destroyed once.
        unsafe { (api.nixl_capi_destroy_string_list)(list) };
        out
    }

    /// The backend's parameters after initialisation and the memory kinds it supports.
    pub fn backend_info(&self) -> Result<BackendInfo, NixlError> {
        let api = self.inner.nixl.api();
        let (mut mems, mut params): (sys::MemListH, sys::ParamsH) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: live agent and backend; writes two handles destroyed below.
        self.inner.check("nixl_capi_get_backend_params", unsafe {
            (api.nixl_capi_get_backend_params)(self.inner.h, self.inner.backend, &mut mems, &mut params)
        })?;
        let kv = read_params(&self.inner, params);
        let mut n = 0usize;
        let mut kinds = Vec::new();
        // SAFETY: a live list; writes one size, then one value per index in range.
        unsafe {
            if (api.nixl_capi_mem_list_size)(mems, &mut n) == sys::SUCCESS {
                for i in 0..n {
                    let mut t: sys::MemType = 0;
                    if (api.nixl_capi_mem_list_get)(mems, i, &mut t) == sys::SUCCESS {
                        kinds.push(mem_type_name(t));
                    }
                }
            }
            (api.nixl_capi_destroy_mem_list)(mems);
            (api.nixl_capi_destroy_params)(params);
        }
        Ok(BackendInfo { name: String::new(), params: kv?, mem_types: kinds })
    }

    /// This agent's metadata (`get_agent_metadata()`: name, backend connection info, every
    /// registered region with its remote key), the bytes a peer loads.
    pub fn local_metadata(&self) -> Result<Vec<u8>, NixlError> {
        let api = self.inner.nixl.api();
        let (mut data, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a live agent; NIXL mallocs `len` bytes at `data`, freed below after the copy.
        self.inner.check("nixl_capi_get_local_md", unsafe {
            (api.nixl_capi_get_local_md)(self.inner.h, &mut data, &mut len)
        })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: `data` holds `len` initialised bytes.
        let out = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
        // SAFETY: allocated with malloc by the C API; freed once.
        unsafe { libc::free(data) };
        Ok(out)
    }

    /// Loads a peer's metadata as a [`Peer`], which forgets it (`invalidate_remote_md`) when
    /// dropped, so a later handshake with a restarted engine starts afresh.
    pub fn load_peer(&self, metadata: &[u8]) -> Result<Peer, NixlError> {
        let name = self.load_remote(metadata)?;
        Ok(Peer { agent: self.inner.clone(), name })
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String, NixlError> {
        let api = self.inner.nixl.api();
        let mut name: *mut c_char = std::ptr::null_mut();
        // SAFETY: reads `len` bytes; writes a malloc'd NUL-terminated name freed below.
        self.inner.check("nixl_capi_load_remote_md", unsafe {
            (api.nixl_capi_load_remote_md)(self.inner.h, metadata.as_ptr().cast(), metadata.len(), &mut name)
        })?;
        if name.is_null() {
            return Err(NixlError::Invalid("NIXL loaded the metadata but returned no agent name".into()));
        }
        // SAFETY: non-null, NUL-terminated; freed once after the copy.
        let s = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        // SAFETY: as above.
        unsafe { libc::free(name.cast()) };
        Ok(s)
    }

    /// Registers `mem` (one region, device `dev`) with the agent's backend.
    pub fn register<M: Registrable>(&self, mem: M, dev: u64) -> Result<Region<M>, NixlError> {
        if mem.is_empty() {
            return Err(NixlError::Invalid("cannot register an empty region".into()));
        }
        let api = self.inner.nixl.api();
        let kind = seg(mem.mem_type());
        let mut list: sys::RegDlistH = std::ptr::null_mut();
        // SAFETY: writes one handle, destroyed by the region's drop.
        self.inner.check("nixl_capi_create_reg_dlist", unsafe {
            (api.nixl_capi_create_reg_dlist)(kind, &mut list)
        })?;
        let addr =
            usize::try_from(mem.addr()).map_err(|_| NixlError::Invalid("address out of range".into()))?;
        // SAFETY: a live list; the descriptor names memory `mem` owns for the region's life.
        let s =
            unsafe { (api.nixl_capi_reg_dlist_add_desc)(list, addr, mem.len(), dev, std::ptr::null(), 0) };
        let s = if s == sys::SUCCESS {
            let args = OptArgs::new(&self.inner)?;
            // SAFETY: live agent, list and arguments; the memory stays allocated until the
            // region deregisters it (Registrable's contract, and the region owns `mem`).
            unsafe { (api.nixl_capi_register_mem)(self.inner.h, list, args.h) }
        } else {
            s
        };
        if s != sys::SUCCESS {
            // SAFETY: created above, destroyed once.
            unsafe { (api.nixl_capi_destroy_reg_dlist)(list) };
            return Err(NixlError::Status {
                op: "nixl_capi_register_mem",
                code: s,
                name: sys::status_name(s),
            });
        }
        Ok(Region {
            agent: self.inner.clone(),
            list,
            addr: mem.addr(),
            len: mem.len(),
            kind,
            dev,
            mem: ManuallyDrop::new(mem),
        })
    }

    /// Prepares a descriptor list on this agent's own memory (vLLM's `prep_xfer_dlist("NIXL_INIT_AGENT", ...)`).
    pub fn prep_local(&self, descs: &[Desc], mem: MemType) -> Result<Prepped, NixlError> {
        self.prep(None, descs, mem)
    }

    /// Prepares a descriptor list on a loaded peer's memory.
    pub fn prep_remote(&self, remote: &str, descs: &[Desc], mem: MemType) -> Result<Prepped, NixlError> {
        self.prep(Some(remote), descs, mem)
    }

    fn prep(&self, remote: Option<&str>, descs: &[Desc], mem: MemType) -> Result<Prepped, NixlError> {
        let api = self.inner.nixl.api();
        let list = XferList::new(&self.inner, descs, seg(mem))?;
        let who = cstring("agent name", remote.unwrap_or(NIXL_INIT_AGENT))?;
        let args = OptArgs::new(&self.inner)?;
        let mut h: sys::XferDlistHandleH = std::ptr::null_mut();
        // SAFETY: live agent, list, arguments and name; writes one handle released on drop.
        self.inner.check("nixl_capi_prep_xfer_dlist", unsafe {
            (api.nixl_capi_prep_xfer_dlist)(self.inner.h, who.as_ptr(), list.h, &mut h, args.h)
        })?;
        Ok(Prepped { agent: self.inner.clone(), h, count: descs.len() })
    }

    /// A transfer from two prepared lists and descriptor indices into them (vLLM's
    /// `make_prepped_xfer`), with the notification the peer receives on completion. NIXL
    /// merges descriptors contiguous on both sides unless `merge` is false (vLLM: merges).
    #[expect(clippy::too_many_arguments, reason = "NIXL's make_xfer_req takes each of these")]
    pub fn make_xfer(
        &self,
        op: Op,
        local: &Prepped,
        local_ids: &[i32],
        remote: &Prepped,
        remote_ids: &[i32],
        notif: Option<&[u8]>,
        merge: bool,
    ) -> Result<Xfer, NixlError> {
        for (ids, p, side) in [(local_ids, local, "local"), (remote_ids, remote, "remote")] {
            if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= p.count) {
                return Err(NixlError::Invalid(format!(
                    "{side} descriptor id {bad} outside the prepared list of {}",
                    p.count
                )));
            }
        }
        if local_ids.len() != remote_ids.len() {
            return Err(NixlError::Invalid(format!(
                "{} local and {} remote descriptor ids",
                local_ids.len(),
                remote_ids.len()
            )));
        }
        let api = self.inner.nixl.api();
        let args = OptArgs::new(&self.inner)?.notif(notif)?;
        if !merge {
            // SAFETY: sets a flag on a live handle.
            self.inner.check("nixl_capi_opt_args_set_skip_desc_merge", unsafe {
                (api.nixl_capi_opt_args_set_skip_desc_merge)(args.h, true)
            })?;
        }
        let mut h: XferReqH = std::ptr::null_mut();
        // SAFETY: live agent, prepared handles of this agent, arguments; indices checked
        // against the lists above; NIXL copies the index arrays. Writes one request handle.
        self.inner.check("nixl_capi_make_xfer_req", unsafe {
            (api.nixl_capi_make_xfer_req)(
                self.inner.h,
                op.raw(),
                local.h,
                local_ids.as_ptr().cast::<c_int>(),
                local_ids.len(),
                remote.h,
                remote_ids.as_ptr().cast::<c_int>(),
                remote_ids.len(),
                &mut h,
                args.h,
            )
        })?;
        Ok(Xfer { agent: self.inner.clone(), h, posted: false })
    }

    /// Notifications received since the last call, as (sender agent, message), in order per sender.
    pub fn notifs(&self) -> Result<Vec<(String, Vec<u8>)>, NixlError> {
        let api = self.inner.nixl.api();
        let mut map: sys::NotifMapH = std::ptr::null_mut();
        // SAFETY: writes one handle destroyed below.
        self.inner
            .check("nixl_capi_create_notif_map", unsafe { (api.nixl_capi_create_notif_map)(&mut map) })?;
        let out = self.drain(map);
        // SAFETY: created above, destroyed once.
        unsafe { (api.nixl_capi_destroy_notif_map)(map) };
        out
    }

    fn drain(&self, map: sys::NotifMapH) -> Result<Vec<(String, Vec<u8>)>, NixlError> {
        let api = self.inner.nixl.api();
        let args = OptArgs::new(&self.inner)?;
        // SAFETY: live agent, map and arguments.
        self.inner.check("nixl_capi_get_notifs", unsafe {
            (api.nixl_capi_get_notifs)(self.inner.h, map, args.h)
        })?;
        let mut agents = 0usize;
        // SAFETY: a live map; writes one size.
        self.inner
            .check("nixl_capi_notif_map_size", unsafe { (api.nixl_capi_notif_map_size)(map, &mut agents) })?;
        let mut out = Vec::new();
        for a in 0..agents {
            let mut name: *const c_char = std::ptr::null();
            // SAFETY: `a` in range; the name lives as long as the map.
            self.inner.check("nixl_capi_notif_map_get_agent_at", unsafe {
                (api.nixl_capi_notif_map_get_agent_at)(map, a, &mut name)
            })?;
            if name.is_null() {
                continue;
            }
            let mut n = 0usize;
            // SAFETY: a live map and one of its names.
            self.inner.check("nixl_capi_notif_map_get_notifs_size", unsafe {
                (api.nixl_capi_notif_map_get_notifs_size)(map, name, &mut n)
            })?;
            // SAFETY: non-null NUL-terminated, owned by the map.
            let who = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
            for i in 0..n {
                let (mut data, mut len): (*const c_void, usize) = (std::ptr::null(), 0);
                // SAFETY: `i` in range; the bytes live as long as the map.
                self.inner.check("nixl_capi_notif_map_get_notif", unsafe {
                    (api.nixl_capi_notif_map_get_notif)(map, name, i, &mut data, &mut len)
                })?;
                let msg = if data.is_null() || len == 0 {
                    Vec::new()
                } else {
                    // SAFETY: `len` initialised bytes owned by the map, copied now.
                    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
                };
                out.push((who.clone(), msg));
            }
        }
        Ok(out)
    }
}

/// A remote agent loaded into this agent: notifications to it, and forgetting it on drop.
pub struct Peer {
    agent: Arc<Inner>,
    name: String,
}

// SAFETY: as for `Region`.
unsafe impl Send for Peer {}

impl Peer {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `gen_notif` to this peer (vLLM's `send_notif`).
    pub fn send_notif(&self, msg: &[u8]) -> Result<(), NixlError> {
        let c = cstring("agent name", &self.name)?;
        let args = OptArgs::new(&self.agent)?;
        // SAFETY: live agent and arguments; NIXL copies `len` bytes.
        self.agent.check("nixl_capi_gen_notif", unsafe {
            (self.agent.nixl.api().nixl_capi_gen_notif)(
                self.agent.h,
                c.as_ptr(),
                msg.as_ptr().cast(),
                msg.len(),
                args.h,
            )
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(c) = CString::new(self.name.as_str()) {
            // SAFETY: a live agent and a NUL-terminated name; an unknown name is an error
            // status, nothing more.
            unsafe { (self.agent.nixl.api().nixl_capi_invalidate_remote_md)(self.agent.h, c.as_ptr()) };
        }
    }
}

/// One descriptor: an address range on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    fn raw(self) -> sys::XferOp {
        match self {
            Op::Read => sys::XFER_OP_READ,
            Op::Write => sys::XFER_OP_WRITE,
        }
    }
}

/// A transfer descriptor list, destroyed on drop.
struct XferList<'a> {
    inner: &'a Inner,
    h: sys::XferDlistH,
}

impl<'a> XferList<'a> {
    fn new(inner: &'a Inner, descs: &[Desc], kind: sys::MemType) -> Result<Self, NixlError> {
        let api = inner.nixl.api();
        let mut h: sys::XferDlistH = std::ptr::null_mut();
        // SAFETY: writes one handle destroyed on drop.
        inner.check("nixl_capi_create_xfer_dlist", unsafe {
            (api.nixl_capi_create_xfer_dlist)(kind, &mut h)
        })?;
        let list = XferList { inner, h };
        for d in descs {
            let addr =
                usize::try_from(d.addr).map_err(|_| NixlError::Invalid("address out of range".into()))?;
            let len = usize::try_from(d.len).map_err(|_| NixlError::Invalid("length out of range".into()))?;
            // SAFETY: a live list; descriptors are plain values NIXL copies.
            inner.check("nixl_capi_xfer_dlist_add_desc", unsafe {
                (api.nixl_capi_xfer_dlist_add_desc)(list.h, addr, len, d.dev)
            })?;
        }
        Ok(list)
    }
}

impl Drop for XferList<'_> {
    fn drop(&mut self) {
        // SAFETY: created by create_xfer_dlist, destroyed once (NIXL copied it when preparing).
        unsafe { (self.inner.nixl.api().nixl_capi_destroy_xfer_dlist)(self.h) };
    }
}

/// A registered region; owns its memory and hands it back only after deregistering.
pub struct Region<M: Registrable> {
    agent: Arc<Inner>,
    list: sys::RegDlistH,
    addr: u64,
    len: usize,
    kind: sys::MemType,
    dev: u64,
    mem: ManuallyDrop<M>,
}

// SAFETY: the region's handles belong to an agent used on one thread at a time (see `Inner`).
unsafe impl<M: Registrable + Send> Send for Region<M> {}

impl<M: Registrable> Region<M> {
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dev(&self) -> u64 {
        self.dev
    }
    pub fn is_device(&self) -> bool {
        self.kind == sys::MEM_VRAM
    }
    pub fn memory(&self) -> &M {
        &self.mem
    }
    /// Mutable access to the memory (filling, verifying); NIXL moves bytes only during
    /// transfers the caller posted and waits for.
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.mem
    }
}

impl<M: Registrable> Region<M> {
    /// Deregisters the region and hands its memory back (a rank whose NIXL side is torn
    /// down keeps its pool).
    pub fn deregister(mut self) -> M {
        self.release();
        // SAFETY: deregistered above; `release` nulled the list, so `drop` takes nothing
        // again, and the memory is taken exactly once, here.
        unsafe { ManuallyDrop::take(&mut self.mem) }
    }

    /// Deregisters and destroys the list, once (a null list was released already).
    fn release(&mut self) {
        if self.list.is_null() {
            return;
        }
        let api = self.agent.nixl.api();
        if let Ok(args) = OptArgs::new(&self.agent) {
            // SAFETY: live agent, list and arguments; the memory is still allocated.
            let s = unsafe { (api.nixl_capi_deregister_mem)(self.agent.h, self.list, args.h) };
            if s != sys::SUCCESS {
                tracing::warn!(status = sys::status_name(s), "NIXL could not deregister a region");
            }
        }
        // SAFETY: created at registration, destroyed once (the list is nulled after).
        unsafe { (api.nixl_capi_destroy_reg_dlist)(self.list) };
        self.list = std::ptr::null_mut();
    }
}

impl<M: Registrable> Drop for Region<M> {
    fn drop(&mut self) {
        if self.list.is_null() {
            // `deregister` took the memory.
            return;
        }
        self.release();
        // SAFETY: deregistered above; the memory is dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.mem) };
    }
}

/// A prepared descriptor list (local or on one peer), released on drop.
pub struct Prepped {
    agent: Arc<Inner>,
    h: sys::XferDlistHandleH,
    count: usize,
}

// SAFETY: as for `Region`.
unsafe impl Send for Prepped {}

impl Prepped {
    /// Descriptors in the list (valid ids are `0..count`).
    pub fn count(&self) -> usize {
        self.count
    }
}

impl Drop for Prepped {
    fn drop(&mut self) {
        // SAFETY: prepared by this agent, released once.
        unsafe { (self.agent.nixl.api().nixl_capi_release_xfer_dlist_handle)(self.agent.h, self.h) };
    }
}

/// Where a transfer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferState {
    InProgress,
    Done,
}

/// NIXL's own timings of one finished transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Telemetry {
    pub post_us: u64,
    pub xfer_us: u64,
    pub bytes: u64,
    pub descs: u64,
}

/// A transfer request; released on drop (NIXL cancels one still in flight).
pub struct Xfer {
    agent: Arc<Inner>,
    h: XferReqH,
    posted: bool,
}

// SAFETY: as for `Region`.
unsafe impl Send for Xfer {}

impl Xfer {
    /// Posts the transfer (again, for a request made once and reused).
    pub fn post(&mut self) -> Result<XferState, NixlError> {
        let api = self.agent.nixl.api();
        // SAFETY: a live request of this agent; no arguments (the notification was set at creation).
        let s = unsafe { (api.nixl_capi_post_xfer_req)(self.agent.h, self.h, std::ptr::null_mut()) };
        self.posted = true;
        state("nixl_capi_post_xfer_req", s)
    }

    /// Progresses and reports the transfer's state; an error state is an error.
    pub fn status(&self) -> Result<XferState, NixlError> {
        // SAFETY: a live request of this agent.
        let s = unsafe { (self.agent.nixl.api().nixl_capi_get_xfer_status)(self.agent.h, self.h) };
        state("nixl_capi_get_xfer_status", s)
    }

    /// NIXL's telemetry for the last completed post (`None` where it kept none).
    pub fn telemetry(&self) -> Option<Telemetry> {
        let mut t = sys::XferTelemetry::default();
        // SAFETY: a live request; writes one struct.
        let s = unsafe { (self.agent.nixl.api().nixl_capi_get_xfer_telemetry)(self.agent.h, self.h, &mut t) };
        (s == sys::SUCCESS).then_some(Telemetry {
            post_us: t.post_duration_us,
            xfer_us: t.xfer_duration_us,
            bytes: t.total_bytes,
            descs: t.desc_count,
        })
    }
}

fn state(op: &'static str, s: Status) -> Result<XferState, NixlError> {
    match s {
        sys::SUCCESS => Ok(XferState::Done),
        sys::IN_PROG => Ok(XferState::InProgress),
        code => Err(NixlError::Status { op, code, name: sys::status_name(code) }),
    }
}

impl Drop for Xfer {
    fn drop(&mut self) {
        let api = self.agent.nixl.api();
        // SAFETY: a live request of this agent, released once; release cancels one in flight.
        let s = unsafe { (api.nixl_capi_release_xfer_req)(self.agent.h, self.h) };
        if s == sys::SUCCESS {
            // SAFETY: released above, so the wrapper holds no request any more; freed once.
            unsafe { (api.nixl_capi_destroy_xfer_req)(self.h) };
        } else if self.posted {
            // Leaked on purpose: NIXL could not cancel it, so it may still be in flight.
            tracing::warn!(status = sys::status_name(s), "NIXL could not release a transfer request");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::memory::{HostBuffer, PageSize};

    const CHILD: &str = "KVX_NIXL_UNIT_CHILD";

    /// Runs `name` in a child copy of this test binary, which ends through [`super::super::leave`]
    /// (a process that loaded NIXL must not run the libraries' finalizers), and checks it passed.
    fn in_child(name: &str, body: fn()) {
        if std::env::var_os(CHILD).is_some() {
            body();
            crate::transfer::nixl::leave(0);
            return;
        }
        let exe = std::env::current_exe().expect("test binary");
        let mut child = std::process::Command::new(exe)
            .args([name, "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .env("NIXL_LOG_LEVEL", "WARN")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn child");
        use wait_timeout::ChildExt as _;
        let Some(status) = child.wait_timeout(std::time::Duration::from_secs(60)).expect("wait") else {
            let _ = child.kill();
            panic!("{name} did not finish within 60 s");
        };
        let out = child.wait_with_output().expect("output");
        assert!(
            status.success(),
            "{name} failed in its child ({status}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Two agents of one process over the wheel's NIXL: A serves a filled buffer, B reads
    /// three slices of it through prepared lists with a notification, and A receives it.
    /// NIXL is a part these tests need (scripts/setup-nixl.sh): missing, they fail.
    #[test]
    fn a_prepared_read_lands_every_byte_and_notifies_the_owner() {
        in_child(
            "transfer::nixl::agent::tests::a_prepared_read_lands_every_byte_and_notifies_the_owner",
            prepared_read,
        );
    }

    fn prepared_read() {
        let nixl = Nixl::load().expect("NIXL (run scripts/setup-nixl.sh)");
        let opts = AgentOptions { progress_thread: false, ..AgentOptions::default() };
        let a = Agent::new(&nixl, "kvx-test-A", &opts).expect("agent A");
        let b = Agent::new(&nixl, "kvx-test-B", &opts).expect("agent B");
        assert!(a.plugins().expect("plugins").iter().any(|p| p == "UCX"));
        let mut src = HostBuffer::alloc(1 << 16, PageSize::Normal).expect("alloc");
        for (i, x) in src.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let src = a.register(src, 0).expect("register A");
        let dst =
            b.register(HostBuffer::alloc(1 << 16, PageSize::Normal).expect("alloc"), 0).expect("register B");
        let name = b.load_remote(&a.local_metadata().expect("md")).expect("load A");
        assert_eq!(name, "kvx-test-A");
        let blocks = |base: u64| {
            (0..4u64).map(|k| Desc { addr: base + k * 4096, len: 4096, dev: 0 }).collect::<Vec<_>>()
        };
        let local = b.prep_local(&blocks(dst.addr()), MemType::Host).expect("prep local");
        let remote = b.prep_remote(&name, &blocks(src.addr()), MemType::Host).expect("prep remote");
        let mut x = b
            .make_xfer(Op::Read, &local, &[0, 1, 2], &remote, &[3, 1, 0], Some(b"req-1:1"), true)
            .expect("make");
        let mut st = x.post().expect("post");
        let t0 = std::time::Instant::now();
        // Without progress threads the owner progresses only when asked (its notification
        // drain), as a prefill engine does every step; the connection's wire-up needs it.
        let mut notifs = Vec::new();
        while st == XferState::InProgress {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "read did not finish");
            notifs.extend(a.notifs().expect("notifs"));
            st = x.status().expect("status");
        }
        let got = dst.memory().as_slice();
        let want = src.memory().as_slice();
        for (l, r) in [(0usize, 3usize), (1, 1), (2, 0)] {
            assert_eq!(got[l * 4096..(l + 1) * 4096], want[r * 4096..(r + 1) * 4096], "block {l} <- {r}");
        }
        assert!(got[3 * 4096..4 * 4096].iter().all(|&v| v == 0), "block 3 untouched");
        while notifs.is_empty() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "no notification");
            notifs = a.notifs().expect("notifs");
        }
        assert_eq!(notifs, vec![("kvx-test-B".to_owned(), b"req-1:1".to_vec())]);
        let bad = b.make_xfer(Op::Read, &local, &[4], &remote, &[0], None, true);
        assert!(matches!(bad, Err(NixlError::Invalid(_))), "an id past the list is refused before NIXL");
    }

    /// vLLM's messages as NIXL notifications (`gen_notif`), as kvx's ranks send them: a
    /// heartbeat that extends a prefill rank's lease, a push registration, kvx's push failure,
    /// each parsed back whole by the receiving agent; then a region deregistered hands its
    /// memory back unchanged.
    #[test]
    fn heartbeats_and_push_messages_cross_as_notifications() {
        in_child(
            "transfer::nixl::agent::tests::heartbeats_and_push_messages_cross_as_notifications",
            notifications,
        );
    }

    fn notifications() {
        use crate::transfer::notify::{LeaseTable, Notification, PushRegistration};
        use std::time::{Duration, Instant};
        let nixl = Nixl::load().expect("NIXL (run scripts/setup-nixl.sh)");
        let opts = AgentOptions { progress_thread: false, ..AgentOptions::default() };
        let p = Agent::new(&nixl, "kvx-test-P", &opts).expect("agent P");
        let d = Agent::new(&nixl, "kvx-test-D", &opts).expect("agent D");
        let mut buf = HostBuffer::alloc(1 << 14, PageSize::Normal).expect("alloc");
        buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = (i % 7) as u8);
        let region = p.register(buf, 0).expect("register P");
        let to_p = d.load_peer(&p.local_metadata().expect("md")).expect("load P");
        let reg = PushRegistration {
            request_id: "d-1".into(),
            decode_engine_id: "D".into(),
            decode_host: "127.0.0.1".into(),
            decode_port: 5600,
            decode_tp_size: 2,
            local_block_ids: vec![vec![3, 4, 5]],
            remote_engine_id: "P".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5500,
            remote_tp_size: 1,
            remote_pp_size: 1,
            remote_request_id: Some("p-1".into()),
        };
        let sent = [
            Notification::Heartbeat { ids: vec!["p-2".into(), "p-3".into()] },
            Notification::PushReg(Box::new(reg)),
            Notification::PushFailed { d_request_id: "d-1".into(), count: 2 },
            Notification::Notif { p_request_id: "p-1".into(), count: 1 },
        ];
        for n in &sent {
            to_p.send_notif(&n.encode().expect("encode")).expect("send");
        }
        let t0 = Instant::now();
        let mut got = Vec::new();
        while got.len() < sent.len() {
            assert!(t0.elapsed() < Duration::from_secs(10), "only {got:?} arrived");
            for (from, msg) in p.notifs().expect("notifs") {
                assert_eq!(from, "kvx-test-D");
                got.push(Notification::parse(&msg).expect("one of vLLM's (or kvx's) messages"));
            }
            // D progresses too: its side of the connection's wire-up.
            let _ = d.notifs();
        }
        assert_eq!(got, sent, "every message whole, in order");
        // The heartbeat extends p-2's lease past its first expiry; p-1 is freed by its count.
        let mut leases = LeaseTable::new(Duration::from_secs(30));
        for id in ["p-1", "p-2"] {
            leases.register(id, None, t0).expect("register");
        }
        let mut freed = Vec::new();
        for n in &got {
            freed.extend(leases.apply(n, t0 + Duration::from_secs(25)));
        }
        assert_eq!(freed, vec!["p-1".to_owned()]);
        assert!(leases.expire(t0 + Duration::from_secs(31)).is_empty(), "p-2 was extended");
        let mem = region.deregister();
        assert!(
            mem.as_slice().iter().enumerate().all(|(i, &x)| x == (i % 7) as u8),
            "the pool comes back as it was"
        );
    }
}
