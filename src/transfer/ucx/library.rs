//! Finding and loading `libucp` at run time, once per process.
//!
//! Search order: `--ucx-lib PATH`, then `KVX_UCX_LIB`, then the project's own install
//! (`KVX_UCX_DIR`, else a `.ucx/` found walking up from the current directory or from the
//! executable), then the system's `libucp.so.0`. UCX cannot be loaded twice into one
//! process (its libraries share sonames), so the first successful load is kept and a
//! request for a different file later is refused with [`UcxError::AlreadyLoaded`].

use std::ffi::{CStr, c_uint};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use serde::{Deserialize, Serialize};

use super::error::{Result, UcxError};
use super::sys::{self, Api};
use crate::vocab::env;

/// The system library's soname, resolved by the dynamic linker's own search path.
pub const SYSTEM_SONAME: &str = "libucp.so.0";

/// Where a project install keeps `libucp.so.0`, relative to its root (see scripts/setup-ucx.sh).
const PROJECT_LIB_RELATIVE: &[&str] = &["libucx/lib/libucp.so.0", "lib/libucp.so.0"];

/// How the library to load was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LibSource {
    /// `--ucx-lib`.
    Flag,
    /// `KVX_UCX_LIB`.
    EnvLib,
    /// The project's own install (`KVX_UCX_DIR` or `.ucx/`).
    Project,
    /// The system's `libucp.so.0`.
    System,
}

impl fmt::Display for LibSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LibSource::Flag => "--ucx-lib",
            LibSource::EnvLib => env::KVX_UCX_LIB,
            LibSource::Project => "project install",
            LibSource::System => "system",
        })
    }
}

/// Inputs of the library search, gathered once so the search itself is testable.
#[derive(Debug, Clone, Default)]
pub struct LibSearch {
    pub flag: Option<PathBuf>,
    pub env_lib: Option<PathBuf>,
    pub env_dir: Option<PathBuf>,
    pub cwd: Option<PathBuf>,
    pub exe: Option<PathBuf>,
}

impl LibSearch {
    /// The search for a given `--ucx-lib` value, reading `KVX_UCX_LIB`/`KVX_UCX_DIR`.
    pub fn from_env(flag: Option<&Path>) -> Self {
        let nonempty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self {
            flag: flag.map(Path::to_path_buf),
            env_lib: nonempty(env::KVX_UCX_LIB),
            env_dir: nonempty(env::KVX_UCX_DIR),
            cwd: std::env::current_dir().ok(),
            exe: std::env::current_exe().ok(),
        }
    }

    /// Candidate libraries in order. An explicit choice (flag or `KVX_UCX_LIB`) is the only
    /// candidate: silently falling back would measure a different UCX than asked for.
    pub fn candidates(&self) -> Vec<(LibSource, PathBuf)> {
        if let Some(p) = &self.flag {
            return vec![(LibSource::Flag, p.clone())];
        }
        if let Some(p) = &self.env_lib {
            return vec![(LibSource::EnvLib, p.clone())];
        }
        let mut out = Vec::new();
        if let Some(dir) = &self.env_dir {
            for rel in PROJECT_LIB_RELATIVE {
                out.push((LibSource::Project, dir.join(rel)));
            }
        }
        if let Some(p) = self.project_install() {
            out.push((LibSource::Project, p));
        }
        out.push((LibSource::System, PathBuf::from(SYSTEM_SONAME)));
        out
    }

    /// `libucp.so.0` of a `.ucx/` install in the current directory, the executable's
    /// directory, or any of their ancestors.
    pub fn project_install(&self) -> Option<PathBuf> {
        let starts = [self.cwd.clone(), self.exe.as_ref().and_then(|e| e.parent().map(Path::to_path_buf))];
        starts.into_iter().flatten().find_map(|start| {
            start.ancestors().find_map(|dir| {
                PROJECT_LIB_RELATIVE.iter().map(|rel| dir.join(".ucx").join(rel)).find(|p| p.is_file())
            })
        })
    }
}

/// One loaded UCX library. Cheap to clone; shared by every handle created from it.
#[derive(Clone)]
pub struct Ucx {
    inner: Arc<Loaded>,
}

struct Loaded {
    api: Api,
    path: PathBuf,
    requested: PathBuf,
    source: LibSource,
    version: String,
    version_triple: (u32, u32, u32),
}

/// What was loaded, for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibInfo {
    /// The file the dynamic linker actually mapped.
    pub library: PathBuf,
    pub version: String,
    pub source: LibSource,
}

static LOADED: Mutex<Option<Ucx>> = Mutex::new(None);

impl Ucx {
    /// Loads UCX following [`LibSearch::from_env`] for the given `--ucx-lib` value.
    pub fn load(flag: Option<&Path>) -> Result<Ucx> {
        Self::load_with(&LibSearch::from_env(flag))
    }

    /// Loads the first candidate of `search` that opens, or returns the library this
    /// process already loaded.
    pub fn load_with(search: &LibSearch) -> Result<Ucx> {
        let mut guard = LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let candidates = search.candidates();
        if let Some(loaded) = guard.as_ref() {
            let explicit = matches!(candidates.first(), Some((LibSource::Flag | LibSource::EnvLib, _)));
            if explicit && !loaded.is_same_file(&candidates[0].1) {
                return Err(UcxError::AlreadyLoaded {
                    loaded: loaded.inner.path.clone(),
                    requested: candidates[0].1.clone(),
                });
            }
            return Ok(loaded.clone());
        }
        let mut failures = Vec::new();
        for (source, path) in &candidates {
            match Self::open(*source, path) {
                Ok(ucx) => {
                    tracing::debug!(path = %ucx.inner.path.display(), version = %ucx.inner.version, "loaded UCX");
                    *guard = Some(ucx.clone());
                    return Ok(ucx);
                }
                Err(e @ UcxError::Symbol { .. }) => return Err(e),
                Err(UcxError::Load { reason, .. }) => failures.push(reason),
                Err(e) => failures.push(e.to_string()),
            }
        }
        Err(UcxError::Load {
            tried: candidates.iter().map(|(_, p)| p.display().to_string()).collect::<Vec<_>>().join(", "),
            reason: failures.join("; "),
        })
    }

    fn open(source: LibSource, path: &Path) -> Result<Ucx> {
        if source != LibSource::System && !path.exists() {
            return Err(UcxError::Load {
                tried: path.display().to_string(),
                reason: format!("{} does not exist", path.display()),
            });
        }
        // SAFETY: loading runs UCX's initialisers, which only set up UCX's own global
        // state; kvx loads at most one UCX per process (guarded by `LOADED`) so two
        // copies never race over those globals.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| UcxError::Load { tried: path.display().to_string(), reason: e.to_string() })?;
        // SAFETY: the library exports the UCP API; `sys` declares the 1.13 signatures,
        // which later releases keep unchanged.
        let api = unsafe { Api::resolve(lib) }
            .map_err(|symbol| UcxError::Symbol { path: path.to_path_buf(), symbol })?;
        let (mut major, mut minor, mut release): (c_uint, c_uint, c_uint) = (0, 0, 0);
        // SAFETY: the three pointers are valid for writes of one c_uint each.
        unsafe { (api.ucp_get_version)(&mut major, &mut minor, &mut release) };
        // SAFETY: returns a pointer to a static NUL-terminated string inside the library.
        let version =
            unsafe { CStr::from_ptr((api.ucp_get_version_string)()) }.to_string_lossy().into_owned();
        let mapped =
            mapped_file_of(api.ucp_init_version as *const libc::c_void).unwrap_or_else(|| path.to_path_buf());
        if (major, minor) < (1, 13) {
            return Err(UcxError::Load {
                tried: path.display().to_string(),
                reason: format!("UCX {version} is too old (kvx needs >= 1.13)"),
            });
        }
        Ok(Ucx {
            inner: Arc::new(Loaded {
                api,
                path: mapped,
                requested: path.to_path_buf(),
                source,
                version,
                version_triple: (major, minor, release),
            }),
        })
    }

    fn is_same_file(&self, other: &Path) -> bool {
        let canon = |p: &Path| std::fs::canonicalize(p).ok();
        other == self.inner.requested
            || other == self.inner.path
            || (canon(other).is_some() && canon(other) == canon(&self.inner.path))
    }

    /// The function table (crate-internal: only the UCX module calls it).
    pub(super) fn api(&self) -> &Api {
        &self.inner.api
    }

    /// The file that was mapped, e.g. `/usr/lib/x86_64-linux-gnu/libucp.so.0`.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// `ucp_get_version_string()`, e.g. `1.22.0`.
    pub fn version(&self) -> &str {
        &self.inner.version
    }

    /// `(major, minor, release)`.
    pub fn version_triple(&self) -> (u32, u32, u32) {
        self.inner.version_triple
    }

    pub fn source(&self) -> LibSource {
        self.inner.source
    }

    pub fn info(&self) -> LibInfo {
        LibInfo {
            library: self.inner.path.clone(),
            version: self.inner.version.clone(),
            source: self.inner.source,
        }
    }

    /// `ucs_status_string(code)`.
    pub fn status_string(&self, code: sys::UcsStatus) -> String {
        // SAFETY: ucs_status_string accepts any code and returns a static string.
        let p = unsafe { (self.api().ucs_status_string)(code) };
        if p.is_null() {
            return String::from("unknown status");
        }
        // SAFETY: non-null pointers from ucs_status_string are static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok(())` for `UCS_OK`, else a typed error naming `op`.
    pub(super) fn check(&self, op: &'static str, code: sys::UcsStatus) -> Result<()> {
        if code == sys::UCS_OK { Ok(()) } else { Err(self.status_error(op, code)) }
    }

    pub(super) fn status_error(&self, op: &'static str, code: sys::UcsStatus) -> UcxError {
        UcxError::Status { op, code, name: sys::status_name(code), description: self.status_string(code) }
    }
}

impl fmt::Debug for Ucx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ucx").field("path", &self.inner.path).field("version", &self.inner.version).finish()
    }
}

/// The path of the shared object containing `addr`, as the dynamic linker mapped it.
fn mapped_file_of(addr: *const libc::c_void) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data; all-zero is a valid "empty" value for dladdr to fill.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and writes into `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname points into the loader's NUL-terminated copy of the file name.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_choices_are_the_only_candidate() {
        let s = LibSearch {
            flag: Some("/x/libucp.so.0".into()),
            env_lib: Some("/y".into()),
            ..Default::default()
        };
        assert_eq!(s.candidates(), vec![(LibSource::Flag, PathBuf::from("/x/libucp.so.0"))]);
        let s = LibSearch { env_lib: Some("/y".into()), ..Default::default() };
        assert_eq!(s.candidates(), vec![(LibSource::EnvLib, PathBuf::from("/y"))]);
    }

    #[test]
    fn project_install_is_found_from_a_subdirectory_and_precedes_the_system() {
        let root = tempfile::tempdir().expect("tempdir");
        let lib = root.path().join(".ucx/libucx/lib");
        std::fs::create_dir_all(&lib).expect("mkdir");
        std::fs::write(lib.join("libucp.so.0"), b"").expect("write");
        let sub = root.path().join("a/b");
        std::fs::create_dir_all(&sub).expect("mkdir");
        let s = LibSearch { cwd: Some(sub), ..Default::default() };
        let c = s.candidates();
        assert_eq!(c[0], (LibSource::Project, lib.join("libucp.so.0")));
        assert_eq!(c.last(), Some(&(LibSource::System, PathBuf::from(SYSTEM_SONAME))));
    }

    #[test]
    fn env_dir_candidates_come_first() {
        let s = LibSearch { env_dir: Some("/opt/u".into()), ..Default::default() };
        let c = s.candidates();
        assert_eq!(c[0], (LibSource::Project, PathBuf::from("/opt/u/libucx/lib/libucp.so.0")));
        assert_eq!(c[1], (LibSource::Project, PathBuf::from("/opt/u/lib/libucp.so.0")));
    }
}
