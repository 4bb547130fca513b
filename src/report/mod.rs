//! Summaries, exporters, comparison and gate (to be written).
