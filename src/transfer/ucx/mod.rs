//! UCX bindings, loaded at run time (to be written).
