//! Zeroed host memory standing in for device or pinned memory, aligned as drivers align it.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

const ALIGN: usize = 256;

pub struct Block {
    pub base: usize,
    pub size: usize,
    layout: Layout,
}

impl Block {
    /// `None` when the host cannot provide `size` bytes (`size` > 0).
    pub fn new(size: usize) -> Option<Block> {
        let layout = Layout::from_size_align(size.max(1), ALIGN).ok()?;
        // SAFETY: the layout's size is at least 1.
        let p = unsafe { alloc_zeroed(layout) };
        (!p.is_null()).then_some(Block {
            base: p as usize,
            size,
            layout,
        })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `Block::new` with this layout, freed once.
        unsafe { dealloc(self.base as *mut u8, self.layout) }
    }
}

/// An emulator's record of one allocation, whatever else it tracks: the bytes it covers.
pub trait Span {
    /// `(base, size)`: the allocation covers `[base, base + size)`.
    fn span(&self) -> (usize, usize);
}

/// An emulator's live allocations, so every pointer can be classified: device and pinned ones by
/// base address, and the device bytes in use per device.
pub struct Allocations<A> {
    pub device: BTreeMap<usize, Arc<A>>,
    pub pinned: BTreeMap<usize, Arc<A>>,
    pub used: HashMap<i32, u64>,
}

impl<A> Default for Allocations<A> {
    fn default() -> Self {
        Allocations {
            device: BTreeMap::new(),
            pinned: BTreeMap::new(),
            used: HashMap::new(),
        }
    }
}

/// The allocation of `map` that `ptr` points into, if any.
pub fn containing<A: Span>(map: &BTreeMap<usize, Arc<A>>, ptr: usize) -> Option<&Arc<A>> {
    map.range(..=ptr).next_back().map(|(_, a)| a).filter(|a| {
        let (base, size) = a.span();
        ptr < base + size
    })
}
