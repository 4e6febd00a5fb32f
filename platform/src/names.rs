//! Names of hprt's enums: one table per enum gives its canonical names (`Display`, `name()`)
//! and the spellings `FromStr` accepts, which the C ABI, the Python binding, the CLI and the
//! environment variables all use ([`named_enum!`]).

use std::fmt;

/// A name that is none of an enum's spellings (what every generated `FromStr` returns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownName {
    /// What was being named ("dtype", "reduce op", …).
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The canonical names, comma-separated.
    pub expected: String,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?}; expected one of {} (spelled exactly)",
            self.what, self.name, self.expected
        )
    }
}

impl std::error::Error for UnknownName {}

/// Gives a fieldless enum its canonical names: `ALL` (in table order), `name()`, `Display`, and
/// a `FromStr` that accepts exactly those names plus the listed aliases (no case folding, no
/// trimming), failing with [`UnknownName`].
///
/// ```
/// #[derive(Clone, Copy, Debug, PartialEq)]
/// enum Mode { Fast, Small }
/// hprt_platform::named_enum!(Mode, "mode", { Fast => "fast", Small => "small" },
///     aliases { "quick" => Fast });
/// assert_eq!("quick".parse::<Mode>(), Ok(Mode::Fast));
/// assert_eq!(Mode::Small.to_string(), "small");
/// assert!("Fast".parse::<Mode>().is_err());
/// ```
#[macro_export]
macro_rules! named_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }
     $(, aliases { $($alias:literal => $target:ident),* $(,)? })? $(,)?) => {
        impl $ty {
            /// Every value, in the order of its names' table.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            /// The canonical name (what `Display` prints and `FromStr` accepts).
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::UnknownName;

            fn from_str(s: &str) -> ::std::result::Result<Self, Self::Err> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    $($($alias => Ok($ty::$target),)*)?
                    _ => Err($crate::UnknownName {
                        what: $what,
                        name: s.to_owned(),
                        expected: [$($name),+].join(", "),
                    }),
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use crate::{BackendKind, DType, ErrorKind, ReduceOp};

    #[test]
    fn canonical_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>(), Ok(d));
        }
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>(), Ok(o));
        }
        for k in BackendKind::ALL {
            assert_eq!(k.name().parse::<BackendKind>(), Ok(k));
        }
        for k in ErrorKind::ALL {
            assert_eq!(k.name().parse::<ErrorKind>(), Ok(k));
        }
    }

    #[test]
    fn dtype_aliases_are_numpy_and_torch_names_spelled_exactly() {
        for (alias, d) in [
            ("float32", DType::F32),
            ("torch.float32", DType::F32),
            ("float", DType::F32),
            ("half", DType::F16),
            ("torch.bfloat16", DType::BF16),
            ("double", DType::F64),
            ("long", DType::I64),
            ("int", DType::I32),
            ("uint8", DType::U8),
        ] {
            assert_eq!(alias.parse::<DType>(), Ok(d), "{alias}");
        }
        for bad in [
            "F32",
            "bf16 ",
            " f32",
            "Float32",
            "BFLOAT16",
            "torch.F16",
            "f 32",
            "torch.f32",
            "",
        ] {
            let e = bad.parse::<DType>().unwrap_err();
            assert_eq!(e.name, bad);
            assert!(e.to_string().starts_with("unknown dtype"), "{e}");
        }
        assert!("Sum".parse::<ReduceOp>().is_err());
        assert!("CPU".parse::<BackendKind>().is_err());
    }
}
