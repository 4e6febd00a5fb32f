//! Function tables filled from a library opened at run time, for NCCL and NVRTC.
//!
//! cudarc's own NCCL and NVRTC loaders search a fixed list of names (without `libnccl.so.2`, the
//! name NCCL ships under, or `libnvrtc.so.13`) and panic on a missing symbol. These tables load
//! from the library [`super::probe`] found, check every required symbol up front and keep
//! optional ones as `Option`, so an old or partial library is a typed error, never a panic.

/// Declares a table struct with one field per function and a `load(Library)` that fills it,
/// or returns the names of the required symbols that are missing.
macro_rules! dyn_table {
    (
        $(#[$meta:meta])*
        pub(crate) struct $name:ident {
            required { $(fn $f:ident($($a:ident: $t:ty),* $(,)?) -> $r:ty;)* }
            optional { $(fn $o:ident($($oa:ident: $ot:ty),* $(,)?) -> $or:ty;)* }
        }
    ) => {
        $(#[$meta])*
        #[allow(non_snake_case)]
        pub(crate) struct $name {
            $(pub(crate) $f: unsafe extern "C" fn($($t),*) -> $r,)*
            $(pub(crate) $o: Option<unsafe extern "C" fn($($ot),*) -> $or>,)*
            /// Keeps the library mapped for as long as the function pointers are used.
            _lib: libloading::Library,
        }

        impl $name {
            #[allow(non_snake_case)]
            pub(crate) fn load(lib: libloading::Library) -> Result<Self, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: the declared signature is the library's documented one.
                    let $f = unsafe {
                        lib.get::<unsafe extern "C" fn($($t),*) -> $r>(
                            concat!(stringify!($f), "\0").as_bytes(),
                        )
                    }
                    .map(|s| *s)
                    .map_err(|_| missing.push(stringify!($f)))
                    .ok();
                )*
                $(
                    // SAFETY: as above.
                    let $o = unsafe {
                        lib.get::<unsafe extern "C" fn($($ot),*) -> $or>(
                            concat!(stringify!($o), "\0").as_bytes(),
                        )
                    }
                    .map(|s| *s)
                    .ok();
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok($name {
                    // Every required symbol resolved: `missing` is empty.
                    $($f: $f.expect("checked above"),)*
                    $($o,)*
                    _lib: lib,
                })
            }
        }
    };
}

pub(crate) use dyn_table;
