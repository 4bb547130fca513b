//! Ground floor: the words every layer shares, as plain data. Nothing here reads, measures or
//! moves anything, and nothing here imports kvx above the other leaves (`error`).
//!
//! - [`model`]: the shape of a model's KV cache ([`model::ModelShape`], dtypes, MLA).
//! - [`env`]: the names of kvx's environment variables.
//! - [`kinds`]: roles, verification modes, transports and memory kinds (typed choices).
//! - [`launcher`]: the launcher (Slurm, Open MPI, torchrun, LeaderWorkerSet, Indexed Job,
//!   Grove) that started this process and the index it gave it.
//! - [`knob`]: the settings a core rule may ask the user to change ([`knob::Knob`]), unspelled.

#![forbid(unsafe_code)]

pub mod env;
pub mod kinds;
pub mod knob;
pub mod launcher;
pub mod model;
