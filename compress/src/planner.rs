//! Layer order learned in the first step, and the choice of tensors that fit a window.

use std::collections::HashMap;

pub use crate::key::LayerId;

/// The order layers run in, learned the first time each is entered: a layer seen for the first
/// time is linked after the current one; a known layer just becomes current.
///
/// ```
/// use hprt_compress::{LayerId, LayerOrder};
/// let mut fwd = LayerOrder::default();
/// for l in [1, 2, 3, 1, 2, 3] {
///     fwd.enter(LayerId(l));
/// }
/// assert_eq!(fwd.order(), &[LayerId(1), LayerId(2), LayerId(3)]);
/// assert_eq!(fwd.prev(LayerId(2)), Some(LayerId(1)));
/// assert_eq!(fwd.next(LayerId(3)), None);
/// ```
#[derive(Clone, Debug, Default)]
pub struct LayerOrder {
    order: Vec<LayerId>,
    position: HashMap<LayerId, usize>,
    current: Option<LayerId>,
}

impl LayerOrder {
    pub fn enter(&mut self, layer: LayerId) {
        if !self.position.contains_key(&layer) {
            self.position.insert(layer, self.order.len());
            self.order.push(layer);
        }
        self.current = Some(layer);
    }
    pub fn current(&self) -> Option<LayerId> {
        self.current
    }
    pub fn order(&self) -> &[LayerId] {
        &self.order
    }
    pub fn prev(&self, layer: LayerId) -> Option<LayerId> {
        let &i = self.position.get(&layer)?;
        i.checked_sub(1).map(|j| self.order[j])
    }
    pub fn next(&self, layer: LayerId) -> Option<LayerId> {
        let &i = self.position.get(&layer)?;
        self.order.get(i + 1).copied()
    }
}

/// Picks candidates in order while their element total stays below `max_numel`; one that
/// would overflow is skipped and later, smaller ones are still tried (as MindSpeed does).
///
/// ```
/// use hprt_compress::fit_window;
/// assert_eq!(fit_window(&[(0, 50), (1, 80), (2, 30)], 100), vec![0, 2]);
/// ```
pub fn fit_window<K: Copy>(candidates: &[(K, usize)], max_numel: usize) -> Vec<K> {
    let mut total = 0usize;
    let mut out = Vec::new();
    for &(k, n) in candidates {
        if total + n < max_numel {
            total += n;
            out.push(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_order_is_learned_separately_and_revisits_do_not_reorder() {
        let mut bwd = LayerOrder::default();
        for l in [3, 2, 1] {
            bwd.enter(LayerId(l));
        }
        bwd.enter(LayerId(2));
        assert_eq!(bwd.order(), &[LayerId(3), LayerId(2), LayerId(1)]);
        assert_eq!(bwd.current(), Some(LayerId(2)));
        assert_eq!(bwd.next(LayerId(3)), Some(LayerId(2)));
        assert_eq!(bwd.prev(LayerId(3)), None);
        assert_eq!(bwd.next(LayerId(9)), None);
    }

    #[test]
    fn window_fit_never_exceeds_the_budget() {
        let c: Vec<(usize, usize)> = (0..50).map(|i| (i, (i * 37) % 23 + 1)).collect();
        for budget in [0, 1, 10, 100, 1000] {
            let picked = fit_window(&c, budget);
            let total: usize = picked.iter().map(|&i| c[i].1).sum();
            assert!(total < budget.max(1));
            if budget > 1000 {
                assert_eq!(picked.len(), c.len());
            }
        }
        assert_eq!(fit_window(&c, usize::MAX).len(), 50);
    }
}
