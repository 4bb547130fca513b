//! Files a user names on the command line (configs, scenarios, rates, thresholds, run
//! summaries), read with a bound: a regular file only (a FIFO or a device such as `/dev/zero`
//! would be read until memory runs out), at most [`MAX_INPUT_BYTES`]. A leaf every layer may
//! use; errors are `std::io::Error`s whose message says what was wrong, for the caller to name
//! its flag.

#![forbid(unsafe_code)]

use std::io::{self, Read};
use std::path::Path;

/// The largest input file kvx reads (64 MiB): far above any config, scenario or run summary.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// The bytes of `path`, a regular file of at most `cap` bytes.
pub fn read_bounded(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        let what =
            if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("it is {what}")));
    }
    if meta.len() > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {} bytes, over the {cap} bytes kvx reads from one file", meta.len()),
        ));
    }
    let mut out = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // A file that grows while it is read stops at the cap too.
    std::fs::File::open(path)?.take(cap + 1).read_to_end(&mut out)?;
    if out.len() as u64 > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it grew past {cap} bytes while read"),
        ));
    }
    Ok(out)
}

/// [`read_bounded`] as UTF-8 text, with [`MAX_INPUT_BYTES`].
pub fn read_text(path: &Path) -> io::Result<String> {
    String::from_utf8(read_bounded(path, MAX_INPUT_BYTES)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "it is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_large_files_are_refused() {
        assert!(
            read_text(Path::new("/dev/zero")).expect_err("device").to_string().contains("not a regular file")
        );
        let dir = tempfile::tempdir().expect("temp dir");
        assert!(read_text(dir.path()).expect_err("dir").to_string().contains("directory"));
        let f = dir.path().join("big");
        std::fs::write(&f, vec![b'x'; 100]).expect("write");
        assert!(read_bounded(&f, 99).is_err());
        assert_eq!(read_bounded(&f, 100).expect("fits").len(), 100);
    }
}
