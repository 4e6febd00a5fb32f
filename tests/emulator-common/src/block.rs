//! Zeroed host memory standing in for device or pinned memory, aligned as drivers align it.

use std::alloc::{alloc_zeroed, dealloc, Layout};

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
