//! Finding and loading `libnixl_capi.so` at run time, once per process.
//!
//! Search order: `KVX_NIXL_LIB` (a file), then an unpacked wheel at `KVX_NIXL_DIR`, then the
//! project's own (`.nixl/`, from `scripts/setup-nixl.sh`, found walking up from the current
//! directory or from the executable). The wheel's libraries find each other, NIXL's plugins
//! and NIXL's own UCX through their rpaths, so nothing is installed system-wide. A host
//! without NIXL gets [`NixlError::Load`] naming what was tried and how to install it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use serde::{Deserialize, Serialize};

use super::NixlError;
use super::sys::Api;
use crate::vocab::env;

/// The NIXL wheel this kvx is tested against (`scripts/setup-nixl.sh` installs it).
pub const TESTED_VERSION: &str = "1.5.1";

/// Where a wheel keeps the C API, relative to its root (cu12 and cu13 builds).
const WHEEL_LIB_RELATIVE: &[&str] =
    &[".nixl_cu12.mesonpy.libs/libnixl_capi.so", ".nixl_cu13.mesonpy.libs/libnixl_capi.so"];

/// Inputs of the library search, gathered once so the search itself is testable.
#[derive(Debug, Clone, Default)]
pub struct LibSearch {
    pub env_lib: Option<PathBuf>,
    pub env_dir: Option<PathBuf>,
    pub cwd: Option<PathBuf>,
    pub exe: Option<PathBuf>,
}

impl LibSearch {
    pub fn from_env() -> Self {
        let nonempty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self {
            env_lib: nonempty(env::KVX_NIXL_LIB),
            env_dir: nonempty(env::KVX_NIXL_DIR),
            cwd: std::env::current_dir().ok(),
            exe: std::env::current_exe().ok(),
        }
    }

    /// Candidate libraries in order; an explicit `KVX_NIXL_LIB` is the only one.
    pub fn candidates(&self) -> Vec<PathBuf> {
        if let Some(p) = &self.env_lib {
            return vec![p.clone()];
        }
        let mut out = Vec::new();
        if let Some(dir) = &self.env_dir {
            out.extend(WHEEL_LIB_RELATIVE.iter().map(|rel| dir.join(rel)));
        }
        let starts = [self.cwd.clone(), self.exe.as_ref().and_then(|e| e.parent().map(Path::to_path_buf))];
        for start in starts.into_iter().flatten() {
            if let Some(p) = start.ancestors().find_map(|dir| {
                WHEEL_LIB_RELATIVE.iter().map(|rel| dir.join(".nixl").join(rel)).find(|p| p.is_file())
            }) && !out.contains(&p)
            {
                out.push(p);
            }
        }
        out
    }
}

/// One loaded NIXL C API. Cheap to clone.
#[derive(Clone)]
pub struct Nixl {
    inner: Arc<Loaded>,
}

struct Loaded {
    api: Api,
    info: NixlInfo,
}

/// What was loaded, for reports and `kvx doctor`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlInfo {
    /// `libnixl_capi.so` as opened.
    pub library: PathBuf,
    /// The wheel's version (from its `dist-info` beside the library), if found.
    pub version: Option<String>,
    /// The UCX build NIXL's UCX plugin links (the wheel's own, `libucp-<hash>.so`), if found.
    pub bundled_ucx: Option<PathBuf>,
}

static LOADED: Mutex<Option<Nixl>> = Mutex::new(None);

impl Nixl {
    /// Loads NIXL following [`LibSearch::from_env`], or returns the library already loaded.
    pub fn load() -> Result<Nixl, NixlError> {
        Self::load_with(&LibSearch::from_env())
    }

    pub fn load_with(search: &LibSearch) -> Result<Nixl, NixlError> {
        let mut guard = LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(loaded) = guard.as_ref() {
            return Ok(loaded.clone());
        }
        let candidates = search.candidates();
        if candidates.is_empty() {
            return Err(NixlError::Load {
                tried: "nothing (no KVX_NIXL_LIB, no KVX_NIXL_DIR, no .nixl/ above the current directory \
                        or the executable)"
                    .into(),
                reason: "NIXL is not installed".into(),
            });
        }
        let mut failures = Vec::new();
        for path in &candidates {
            match Self::open(path) {
                Ok(n) => {
                    *guard = Some(n.clone());
                    return Ok(n);
                }
                Err(e @ NixlError::Symbol { .. }) => return Err(e),
                Err(e) => failures.push(e.to_string()),
            }
        }
        Err(NixlError::Load {
            tried: candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            reason: failures.join("; "),
        })
    }

    fn open(path: &Path) -> Result<Nixl, NixlError> {
        if !path.is_file() {
            return Err(NixlError::Load {
                tried: path.display().to_string(),
                reason: format!("{} does not exist", path.display()),
            });
        }
        // SAFETY: loading runs NIXL's and its dependencies' initialisers, which set up only
        // their own globals; kvx loads at most one NIXL per process (guarded by `LOADED`).
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| NixlError::Load { tried: path.display().to_string(), reason: e.to_string() })?;
        // SAFETY: the file is NIXL's C API; `sys` declares the 1.5.1 signatures.
        let api = unsafe { Api::resolve(lib) }
            .map_err(|symbol| NixlError::Symbol { path: path.to_path_buf(), symbol })?;
        // SAFETY: takes no arguments and returns a bool.
        if unsafe { (api.nixl_capi_is_stub)() } {
            return Err(NixlError::Load {
                tried: path.display().to_string(),
                reason: "it is NIXL's stub C API (built without NIXL)".into(),
            });
        }
        let info = NixlInfo {
            library: path.to_path_buf(),
            version: wheel_version(path),
            bundled_ucx: bundled_ucx(path),
        };
        Ok(Nixl { inner: Arc::new(Loaded { api, info }) })
    }

    pub(super) fn api(&self) -> &Api {
        &self.inner.api
    }

    pub fn info(&self) -> &NixlInfo {
        &self.inner.info
    }

    /// The version of NIXL's own UCX, once its UCX backend loaded it (`None` before, or when
    /// the wheel's layout is not the one kvx knows).
    pub fn bundled_ucx_version(&self) -> Option<String> {
        let path = self.inner.info.bundled_ucx.as_ref()?;
        // SAFETY: RTLD_NOLOAD only returns a library already mapped (by NIXL's UCX plugin)
        // and runs no initialisers; the handle is dropped (dlclose'd) below, leaving it mapped.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL | libc::RTLD_NOLOAD) }.ok()?;
        // SAFETY: `ucp_get_version_string` takes nothing and returns a static string.
        let f = unsafe {
            lib.get::<unsafe extern "C" fn() -> *const std::ffi::c_char>(b"ucp_get_version_string\0")
        }
        .ok()?;
        // SAFETY: as above; the pointer is to a NUL-terminated string inside the library.
        let p = unsafe { f() };
        (!p.is_null()).then(|| {
            // SAFETY: non-null, NUL-terminated, static in the still-mapped library.
            unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
    }
}

/// Whether this process loaded NIXL.
pub fn loaded() -> bool {
    LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).is_some()
}

/// Ends a process that loaded NIXL with `code` without running the shared libraries'
/// finalizers; returns (doing nothing) in one that did not.
///
/// The wheel's UCX loads its EFA module, which pulls the system's `libibverbs` and `libnl`
/// beside the wheel's own copies; at exit the wheel's `libnl-route` finalizer then crashes
/// (SIGSEGV in `rtnl_tc_unregister`, seen with nixl-cu12 1.5.1 on Debian with rdma-core),
/// turning a finished run's exit code into 139. Everything kvx writes is flushed first.
pub fn leave(code: u8) {
    if !loaded() {
        return;
    }
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; every file kvx wrote was closed or flushed
    // by its owner before the command returned, and stdout/stderr were flushed above.
    unsafe { libc::_exit(i32::from(code)) }
}

/// Ends the process with `code` now, as `std::process::exit` does, without running the exit
/// finalizers NIXL's bundled libraries crash in (see [`leave`]).
pub fn exit(code: u8) -> ! {
    leave(code);
    std::process::exit(i32::from(code))
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl").field("library", &self.inner.info.library).finish()
    }
}

/// The wheel root: the directory holding `.nixl_cu1X.mesonpy.libs/`.
fn wheel_root(lib: &Path) -> Option<&Path> {
    lib.parent()?.parent()
}

/// `1.5.1` from `nixl_cu12-1.5.1.dist-info` (or the marker `scripts/setup-nixl.sh` leaves).
fn wheel_version(lib: &Path) -> Option<String> {
    let root = wheel_root(lib)?;
    let names: Vec<String> = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.iter().find_map(|n| {
        let rest = n.strip_prefix("nixl_cu12-").or_else(|| n.strip_prefix("nixl_cu13-"))?;
        rest.strip_suffix(".dist-info").map(str::to_owned)
    })
}

/// NIXL's own UCX: `libucp-<hash>.so*` in the wheel's `nixl_cu1X.libs/`.
fn bundled_ucx(lib: &Path) -> Option<PathBuf> {
    let root = wheel_root(lib)?;
    ["nixl_cu12.libs", "nixl_cu13.libs"].iter().find_map(|d| {
        let dir = root.join(d);
        std::fs::read_dir(&dir).ok()?.flatten().map(|e| e.path()).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libucp-") && n.contains(".so"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_library_is_the_only_candidate() {
        let s = LibSearch {
            env_lib: Some("/x/libnixl_capi.so".into()),
            env_dir: Some("/y".into()),
            ..Default::default()
        };
        assert_eq!(s.candidates(), vec![PathBuf::from("/x/libnixl_capi.so")]);
    }

    #[test]
    fn the_project_install_is_found_from_a_subdirectory() {
        let root = tempfile::tempdir().expect("tempdir");
        let libs = root.path().join(".nixl/.nixl_cu12.mesonpy.libs");
        std::fs::create_dir_all(&libs).expect("mkdir");
        std::fs::write(libs.join("libnixl_capi.so"), b"").expect("write");
        std::fs::create_dir_all(root.path().join(".nixl/nixl_cu12-1.5.1.dist-info")).expect("mkdir");
        let sub = root.path().join("a/b");
        std::fs::create_dir_all(&sub).expect("mkdir");
        let s = LibSearch { cwd: Some(sub), ..Default::default() };
        assert_eq!(s.candidates(), vec![libs.join("libnixl_capi.so")]);
        assert_eq!(wheel_version(&libs.join("libnixl_capi.so")).as_deref(), Some("1.5.1"));
    }

    #[test]
    fn no_install_is_a_load_error_that_says_how_to_install() {
        let empty = tempfile::tempdir().expect("tempdir");
        // The root has no `.nixl/` (a temp dir may sit inside the project, which has one).
        let _ = empty;
        let s = LibSearch { cwd: Some(PathBuf::from("/")), ..Default::default() };
        assert!(s.candidates().is_empty());
    }
}
