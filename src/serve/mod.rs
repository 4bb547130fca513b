//! Reference engine, proxy and load generator (to be written).
