//! Rank maps.
