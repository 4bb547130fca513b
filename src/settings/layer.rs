//! One definition per setting: a command's settings are one struct that is both its clap
//! arguments and the serde shape of its config file ([`layered!`]), and [`Layered::merge`]
//! lays the flags over the file, field by field, remembering which layer gave each value.
//! Defaults belong to each setting's rule (`unwrap_or`), so a value neither layer gives comes
//! from the default.
//!
//! An error about a value names what to change: the flag (`--inflight`), or the config key and
//! file (`inflight in ci.toml`) when the file gave it ([`Layered::attribute`]). Every config
//! key is its flag's name without the dashes, `-` written `_`.
//!
//! Must not run anything; reads only the config file it is given.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::error::ConfigError;

/// A settings struct as a layer: one field per setting, each a [`Field`].
pub trait Layer: Sized {
    /// This layer over `under`: each value given here wins, the others come from `under`.
    fn over(self, under: Self) -> Self;
    /// Whether this layer gives the setting `key` (a config key); `None`: no setting has it.
    fn gives(&self, key: &str) -> Option<bool>;
    /// The key of a group field (a flattened struct) whose value in `table` is refused, with
    /// the reason: serde reports such errors without the key, as the group is flattened.
    fn locate(table: &toml::Table) -> Option<(String, String)>;
}

/// One setting of a layer: not given (`None`, `false`) or given; a flattened group of
/// settings (a [`layered!`] struct) is a field too.
pub trait Field: Sized {
    /// This value over `under`'s.
    fn over(self, under: Self) -> Self;
    /// Whether the field `name` is the setting `key` and is given (`None`: another setting).
    fn gives(&self, name: &str, key: &str) -> Option<bool>;
    /// A group's refused key in `table` (see [`Layer::locate`]); a plain value has none.
    fn locate(_table: &toml::Table) -> Option<(String, String)> {
        None
    }
}

impl<T> Field for Option<T> {
    fn over(self, under: Self) -> Self {
        self.or(under)
    }

    fn gives(&self, name: &str, key: &str) -> Option<bool> {
        (name == key).then_some(self.is_some())
    }
}

/// A switch: given when on (a flag cannot turn off what the file turned on).
impl Field for bool {
    fn over(self, under: Self) -> Self {
        self || under
    }

    fn gives(&self, name: &str, key: &str) -> Option<bool> {
        (name == key).then_some(*self)
    }
}

/// Declares a settings struct (attributes and fields written as for any struct: clap's
/// `#[arg]`, serde's `#[serde]`) and makes it a [`Layer`] and a [`Field`] (a group other
/// settings structs flatten). Every field is a [`Field`]: `Option<T>`, `bool`, or a group.
macro_rules! layered {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $fvis:vis $field:ident : $ty:ty
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $(#[$fmeta])* $fvis $field: $ty, )*
        }

        impl $crate::settings::layer::Layer for $name {
            fn over(self, under: Self) -> Self {
                Self { $( $field: $crate::settings::layer::Field::over(self.$field, under.$field), )* }
            }

            fn gives(&self, key: &str) -> Option<bool> {
                $(
                    if let Some(given) =
                        $crate::settings::layer::Field::gives(&self.$field, stringify!($field), key)
                    {
                        return Some(given);
                    }
                )*
                None
            }

            fn locate(table: &toml::Table) -> Option<(String, String)> {
                $(
                    if let Some(found) = <$ty as $crate::settings::layer::Field>::locate(table) {
                        return Some(found);
                    }
                )*
                None
            }
        }

        impl $crate::settings::layer::Field for $name {
            fn over(self, under: Self) -> Self {
                <Self as $crate::settings::layer::Layer>::over(self, under)
            }

            fn gives(&self, _name: &str, key: &str) -> Option<bool> {
                <Self as $crate::settings::layer::Layer>::gives(self, key)
            }

            fn locate(table: &toml::Table) -> Option<(String, String)> {
                $crate::settings::layer::refused_key::<Self>(table)
                    .or_else(|| <Self as $crate::settings::layer::Layer>::locate(table))
            }
        }
    };
}
pub(crate) use layered;

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source<'a> {
    /// Its flag.
    Flag,
    /// Its key in the config file.
    File { key: String, path: &'a Path },
    /// Neither: the setting's default.
    Default,
}

/// A command's settings: the flags over the config file, and which gave each value.
#[derive(Debug, Clone)]
pub struct Layered<T> {
    /// The value of every setting the flags or the file give (the rest: `None`, `false`).
    pub values: T,
    flags: T,
    file: Option<(PathBuf, T)>,
}

impl<T: Layer + Clone> Layered<T> {
    /// Lays `flags` over `file` (read from the path beside it).
    pub fn merge(flags: T, file: Option<(PathBuf, T)>) -> Self {
        let values = match &file {
            Some((_, f)) => flags.clone().over(f.clone()),
            None => flags.clone(),
        };
        Layered { values, flags, file }
    }

    /// Where the value of the setting behind `flag` (`--inflight`) came from.
    pub fn source(&self, flag: &str) -> Source<'_> {
        let key = key_of(flag);
        if self.flags.gives(&key) == Some(true) {
            return Source::Flag;
        }
        match &self.file {
            Some((path, file)) if file.gives(&key) == Some(true) => Source::File { key, path },
            _ => Source::Default,
        }
    }

    /// Renames an error's flag to the config key and file when the file gave the value the
    /// error is about: `inflight in ci.toml`.
    pub fn attribute(&self, e: ConfigError) -> ConfigError {
        match self.source(&e.flag) {
            Source::File { key, path } => {
                ConfigError { flag: format!("{key} in {}", path.display()), reason: e.reason }
            }
            Source::Flag | Source::Default => e,
        }
    }
}

/// The config key of a flag: `--prompt-len` is `prompt_len`.
pub fn key_of(flag: &str) -> String {
    flag.trim_start_matches("--").replace('-', "_")
}

/// Reads a config file (TOML) into a layer. A file that cannot be read or parsed, or that has
/// a key no setting has, is refused whole (naming `flag`); a value refused at a key names the
/// key and file (`verify in ci.toml`).
pub fn load<T: Layer + DeserializeOwned>(path: &Path, flag: &str) -> Result<T, ConfigError> {
    let text = crate::input::read_text(path)
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", path.display())))?;
    let whole = |e: &dyn std::fmt::Display| ConfigError::new(flag, format!("{}: {e}", path.display()));
    let de = toml::Deserializer::parse(&text).map_err(|e| whole(&e))?;
    let e = match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(layer) => return Ok(layer),
        Err(e) => e,
    };
    let at_key = match e.path().iter().next() {
        Some(serde_path_to_error::Segment::Map { key }) => {
            Some((key.clone(), e.inner().message().to_string()))
        }
        _ => toml::from_str::<toml::Table>(&text).ok().and_then(|table| T::locate(&table)),
    };
    match at_key {
        Some((key, reason)) => Err(ConfigError::new(format!("{key} in {}", path.display()), reason)),
        None => Err(whole(e.inner())),
    }
}

/// The key of a group's setting refused in `table`, and why (the group read alone, which
/// takes only its own keys).
pub fn refused_key<T: DeserializeOwned>(table: &toml::Table) -> Option<(String, String)> {
    let e = serde_path_to_error::deserialize::<_, T>(toml::Value::Table(table.clone())).err()?;
    match e.path().iter().next() {
        Some(serde_path_to_error::Segment::Map { key }) => {
            Some((key.clone(), e.inner().message().to_string()))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use serde::Deserialize;

    use super::*;

    layered! {
        #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
        struct Group {
            depth: Option<u32>,
            #[serde(default, deserialize_with = "crate::settings::parse::opt_choice")]
            mode: Option<crate::topology::TransferMode>,
        }
    }

    layered! {
        #[derive(Debug, Clone, Default, PartialEq, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Top {
            #[serde(flatten)]
            group: Group,
            width: Option<u32>,
            wide: bool,
            #[serde(skip)]
            flag_only: Option<u32>,
        }
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp file");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    #[test]
    fn flags_over_file_each_value_knowing_its_layer() {
        let f = file("width = 3\ndepth = 4\nwide = true\n");
        let from_file: Top = load(f.path(), "--config").expect("valid");
        let flags = Top { width: Some(5), ..Top::default() };
        let m = Layered::merge(flags, Some((f.path().to_path_buf(), from_file)));
        assert_eq!((m.values.width, m.values.group.depth, m.values.wide), (Some(5), Some(4), true));
        assert_eq!(m.values.flag_only, None, "the file cannot give it");
        assert_eq!(m.source("--width"), Source::Flag);
        assert_eq!(m.source("--depth"), Source::File { key: "depth".into(), path: f.path() });
        assert_eq!(m.source("--mode"), Source::Default);
        assert_eq!(m.source("--nothing"), Source::Default);
        let e = m.attribute(ConfigError::new("--depth", "too deep"));
        assert_eq!(e.flag, format!("depth in {}", f.path().display()));
        assert_eq!(m.attribute(ConfigError::new("--width", "x")).flag, "--width");
    }

    #[test]
    fn a_refused_value_names_its_key_even_in_a_flattened_group() {
        for (text, key) in
            [("width = \"x\"", "width"), ("mode = \"sideways\"", "mode"), ("depth = -1", "depth")]
        {
            let f = file(text);
            let e = load::<Top>(f.path(), "--config").expect_err(text);
            assert_eq!(e.flag, format!("{key} in {}", f.path().display()), "{text}: {e}");
        }
        let f = file("mode = \"sideways\"");
        let e = load::<Top>(f.path(), "--config").expect_err("bad mode");
        assert_eq!(e.reason, "'sideways' is not pull or push");
        // An unknown key (a flag-only setting included) and a syntax error refuse the file.
        for text in ["wdth = 3", "flag_only = 1", "width = ["] {
            let f = file(text);
            assert_eq!(load::<Top>(f.path(), "--config").expect_err(text).flag, "--config", "{text}");
        }
    }
}
