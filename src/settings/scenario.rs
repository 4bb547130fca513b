//! (scenario resolution, to be written)
