//! An emulator's test-only exports, typed by the binary's statistics struct `S` (the layout
//! that emulator's `stats` export writes): one wrapper for both emulator binaries
//! (`cuda_emulator.rs`, `npu_backend.rs`).

use std::marker::PhantomData;
use std::path::Path;

use hprt_conformance::emulator::Control;

pub struct Emu<S>(pub Control, PhantomData<S>);

impl<S: Default> Emu<S> {
    pub fn open_at(lib: &Path) -> Self {
        Emu(Control::open(lib), PhantomData)
    }

    pub fn stats(&self) -> S {
        self.0.stats()
    }

    pub fn faults(&self, spec: &str) {
        self.0.faults(spec)
    }
}
