//! P and D workers, request lifecycle, workloads and the `kvx bench` orchestrator (to be written).
