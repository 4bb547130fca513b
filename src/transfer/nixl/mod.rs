//! NIXL, loaded at run time from the C API its PyPI wheel ships (`libnixl_capi.so`).
//!
//! kvx moves the same plans through NIXL that it moves through its own UCX binding, so kvx
//! engines and vLLM engines can read from each other and NIXL's cost over raw UCX is a
//! measured figure. Nothing about NIXL enters the build: the library is found and opened
//! when `--transport nixl` (or `kvx doctor`, or `kvx probe` of a NIXL agent blob) needs it.

pub mod blob;
