//! KV cache layouts (to be written).
