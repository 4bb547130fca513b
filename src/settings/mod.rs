//! Settings: every environment variable kvx reads (`env`), model shapes (`model`), and
//! the resolution of flags, config files and environment into validated settings
//! (`scenario`). Cross-flag checks live here and name the flag to change.

pub mod env;
pub mod model;
pub mod scenario;
