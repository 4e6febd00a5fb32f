//! Memory plus a byte offset, and "device or page-locked host memory": the two shapes every
//! layer names memory with, from the handles callers hold down to a backend's own objects
//! (generic over them: this module sits below `handle.rs`, which gives its buffers the
//! conversions), and the direction of a copy between two kinds of memory.
//!
//! | | callers (handles) | a backend ([`crate::Backend`]) |
//! |---|---|---|
//! | a place in device memory (kernels, collectives) | `Place<&DeviceBuffer>` | `Place<B::DeviceMemory>` |
//! | one end of a copy | `Memory<&DeviceBuffer, &PinnedBuffer>` and an offset | `Place<Memory<B::DeviceMemory, B::PinnedMemory>>` |

/// A memory object and a byte offset into it. Callers hold `Place<&DeviceBuffer>`
/// ([`crate::DeviceBuffer::at`]); a backend receives the same place in its own memory type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place<M> {
    pub mem: M,
    pub offset: usize,
}

impl<M> Place<M> {
    pub fn new(mem: M, offset: usize) -> Self {
        Place { mem, offset }
    }

    /// The same offset into the memory `f` makes of this place's memory.
    pub fn map<N>(self, f: impl FnOnce(M) -> N) -> Place<N> {
        Place {
            mem: f(self.mem),
            offset: self.offset,
        }
    }
}

/// The start of the memory.
impl<M> From<M> for Place<M> {
    fn from(mem: M) -> Self {
        Place { mem, offset: 0 }
    }
}

/// Device memory or page-locked host memory: one end of a copy. Callers pass
/// `Memory<&DeviceBuffer, &PinnedBuffer>`; a backend receives
/// `Memory<B::DeviceMemory, B::PinnedMemory>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory<D, P> {
    Device(D),
    Pinned(P),
}

impl<D, P> Memory<D, P> {
    pub fn is_pinned(&self) -> bool {
        matches!(self, Memory::Pinned(_))
    }

    /// The same kind of memory, by reference.
    pub fn as_ref(&self) -> Memory<&D, &P> {
        match self {
            Memory::Device(d) => Memory::Device(d),
            Memory::Pinned(p) => Memory::Pinned(p),
        }
    }

    /// The same kind of memory, each kind's object made by its function.
    pub fn map<E, Q>(
        self,
        device: impl FnOnce(D) -> E,
        pinned: impl FnOnce(P) -> Q,
    ) -> Memory<E, Q> {
        match self {
            Memory::Device(d) => Memory::Device(device(d)),
            Memory::Pinned(p) => Memory::Pinned(pinned(p)),
        }
    }
}

impl<T> Memory<T, T> {
    /// The object, whichever kind of memory it is (for a backend whose device and pinned
    /// memory are one type).
    pub fn into_inner(self) -> T {
        match self {
            Memory::Device(m) | Memory::Pinned(m) => m,
        }
    }
}

/// The direction of a copy, named as drivers name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    HostToHost,
}

impl CopyKind {
    /// The direction of a copy from `src` to `dst`.
    pub fn between<D, P, E, Q>(dst: &Memory<D, P>, src: &Memory<E, Q>) -> CopyKind {
        match (src, dst) {
            (Memory::Pinned(_), Memory::Device(_)) => CopyKind::HostToDevice,
            (Memory::Device(_), Memory::Pinned(_)) => CopyKind::DeviceToHost,
            (Memory::Device(_), Memory::Device(_)) => CopyKind::DeviceToDevice,
            (Memory::Pinned(_), Memory::Pinned(_)) => CopyKind::HostToHost,
        }
    }
}
