//! Byte-meaning check of hybrid plans (filled in below).
