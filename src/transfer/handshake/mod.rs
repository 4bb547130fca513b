//! ZMQ side channel (to be written).
