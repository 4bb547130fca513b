//! Flags shared by several subcommands (to be written).
