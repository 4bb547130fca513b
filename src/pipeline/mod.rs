//! The P/D pipeline: engines made of worker processes (one per TP rank), the request
//! lifecycle between them, and the `kvx bench` driver on top (one bench, a sweep, a
//! comparison of runs that differ in one setting).
//!
//! Owns: worker processes, block pools, the control protocol, workloads, the request
//! lifecycle (fill, hold under a lease, read, verify, notify, free). Uses `layouts` for
//! plans and `transfer` for bytes on the wire; hands measurements to `report`. `kvx bench`'s
//! calibration is a `kvx xfer` measurement, run through the runner `cli` hands it
//! (`bench::XferRunner`): `pipeline` never imports `diagnose`.
//!
//! Cut along the processes that run: [`engine`] runs in the process that schedules (the
//! bench, a serving engine), [`worker`] is each rank's own process, [`bench`] drives a run;
//! [`wire`] is what the first two say to each other.

#![forbid(unsafe_code)]

pub mod bench;
pub mod engine;
pub mod params;
pub mod wire;
pub mod worker;
