//! How hprt names a saved activation, in every front end: the layer that saved it, and its place
//! in that layer's save order. The swap front ends (hyper_parallel's layer groups and keyed swap)
//! and MindSpeed's activation manager use these two types, so a key means one thing everywhere.

/// A layer: the index a front end gave it at registration, or a framework's stable module id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerId(pub usize);

impl LayerId {
    pub fn index(self) -> usize {
        self.0
    }
}

/// A saved tensor: its layer, then its index among that layer's saved tensors in save order
/// (keys order by layer first, so one layer's keys form a contiguous range).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorKey {
    pub layer: LayerId,
    pub index: usize,
}

impl TensorKey {
    pub fn new(layer: usize, index: usize) -> Self {
        TensorKey {
            layer: LayerId(layer),
            index,
        }
    }

    /// Every key of `layer`, as a range of keys.
    pub fn layer_range(layer: usize) -> std::ops::Range<TensorKey> {
        TensorKey::new(layer, 0)..TensorKey::new(layer + 1, 0)
    }
}
