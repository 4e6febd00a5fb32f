//! [`Schedule::Eager`](super::Schedule::Eager): `save` queues each encode, a later `save` or `take` lets go of the
//! originals whose encodes finished, and `take` begins the decodes of the tensors backward
//! reads next (the latest saved first) before it waits for its own.

use hprt_platform::DeviceBuffer;

use super::{ActivationManager, State};
use crate::error::Result;
use crate::key::TensorKey;
use crate::planner::LayerId;

impl ActivationManager {
    /// Queues the encode of the tensor `save` just registered, after the work the compute
    /// stream holds now (its producer among it); first lets go of the originals whose encodes
    /// finished. An encode that cannot be queued keeps its tensor as it is.
    pub(super) fn encode_on_save(&mut self, layer: LayerId, index: usize) -> Result<()> {
        self.finish_encodes()?;
        let ready = self.p.create_event(false)?;
        self.p.record_event(&ready, &self.compute)?;
        self.p.stream_wait_event(&self.side, &ready)?;
        match self.launch_encode(layer, index) {
            Ok(q) => {
                self.entry_mut(layer, index)?.state = State::Encoding;
                self.encoding.push_back(q);
                Ok(())
            }
            Err(err) => self.encode_failed(layer, index, err),
        }
    }

    /// Finishes the queued encodes that completed, oldest first (they run in that order on the
    /// side stream), without waiting for the others.
    fn finish_encodes(&mut self) -> Result<()> {
        while let Some(q) = self.encoding.front() {
            if !q.pending.is_done(self.p.as_ref())? {
                break;
            }
            let q = self.encoding.pop_front().expect("checked");
            self.finish_encode(q)?;
        }
        Ok(())
    }

    /// The encode of entry `index` is no longer wanted (its tensor is taken or discarded
    /// first): the encodes queued before it are finished, it is waited for (it reads the
    /// tensor's memory) and dropped, and the tensor stays as it is.
    fn cancel_encode(&mut self, layer: LayerId, index: usize) -> Result<()> {
        while let Some(q) = self.encoding.pop_front() {
            if q.index != index {
                self.finish_encode(q)?;
                continue;
            }
            // Its length or error does not matter any more, only that it ran.
            let _ = q.pending.wait_len(self.p.as_ref());
            let (dtype, numel) = (q.pending.dtype(), q.pending.numel());
            self.pool.entry((numel, dtype)).or_default().push(q.scratch);
            break;
        }
        self.entry_mut(layer, index)?.state = State::Normal;
        Ok(())
    }

    /// Queues the decode of a compressed entry into its re-acquired memory.
    fn launch_decode(&mut self, layer: LayerId, index: usize) -> Result<()> {
        let (p, codec, side) = (self.p.clone(), self.codec.clone(), self.side.clone());
        let e = self.entry_mut(layer, index)?;
        if !matches!(e.state, State::Compressed(_)) {
            return Ok(());
        }
        e.reacquire(p.as_ref())?;
        let State::Compressed(ct) = std::mem::replace(&mut e.state, State::Normal) else {
            unreachable!("checked above");
        };
        match codec.decode_async(p.as_ref(), &ct, e.tensor.place(), &side) {
            Ok(pending) => {
                e.state = State::Decoding(ct, pending);
                Ok(())
            }
            Err(err) => {
                e.state = State::Compressed(ct);
                Err(err)
            }
        }
    }

    /// Begins the decode of `key` if it is compressed, then those of the latest saved
    /// compressed tensors after it, until `ahead` others are in flight. A decode ahead that
    /// finds no memory leaves its tensor compressed (its own `take` decodes it).
    fn begin_decodes(&mut self, key: TensorKey, ahead: usize) -> Result<()> {
        // Nothing on the side stream may run before the compute stream reached this point.
        let ready = self.p.create_event(false)?;
        self.p.record_event(&ready, &self.compute)?;
        self.p.stream_wait_event(&self.side, &ready)?;
        self.launch_decode(key.layer, key.index)?;
        let mut next: Vec<(usize, LayerId, bool)> = self
            .layers
            .iter()
            .flat_map(|(l, v)| v.iter().map(move |e| (e, *l)))
            .filter(|(e, _)| e.index != key.index && e.state.compressed())
            .map(|(e, l)| (e.index, l, matches!(e.state, State::Decoding(..))))
            .collect();
        next.sort_unstable_by_key(|n| std::cmp::Reverse(n.0));
        let mut in_flight = next.iter().filter(|n| n.2).count();
        for (index, layer, decoding) in next {
            if in_flight >= ahead {
                break;
            }
            if decoding {
                continue;
            }
            if let Err(err) = self.launch_decode(layer, index) {
                tracing::debug!("no decode ahead for a tensor of layer {}: {err}", layer.0);
                break;
            }
            in_flight += 1;
        }
        Ok(())
    }

    /// [`ActivationManager::take`] under [`Schedule::Eager`](super::Schedule::Eager).
    pub(super) fn take_eager(&mut self, key: TensorKey, ahead: usize) -> Result<DeviceBuffer> {
        let state = &self.entry_mut(key.layer, key.index)?.state;
        let begun_ahead = matches!(state, State::Decoding(..));
        if matches!(state, State::Encoding) {
            self.cancel_encode(key.layer, key.index)?;
        }
        self.finish_encodes()?;
        self.begin_decodes(key, ahead)?;
        let p = self.p.clone();
        let e = self.entry_mut(key.layer, key.index)?;
        if matches!(e.state, State::Decoding(..)) {
            let State::Decoding(ct, pending) = std::mem::replace(&mut e.state, State::Normal)
            else {
                unreachable!("checked above");
            };
            // The host waits for this decode alone (not the ones begun after it), so the
            // memory is complete when `take` returns.
            if let Err(err) = pending.finish(p.as_ref()) {
                e.state = State::Compressed(ct);
                return Err(err);
            }
            let s = self.stats.entry(key.layer).or_default();
            if begun_ahead {
                s.decoded_ahead += 1;
            } else {
                s.recovered_sync += 1;
            }
        }
        self.forget(key)
    }

    /// Before an entry goes (`discard`): its queued encode or decode has run, so nothing
    /// queued reads or writes its memory afterwards. Unknown keys are left alone.
    pub(super) fn settle(&mut self, key: TensorKey) -> Result<()> {
        let Some(e) = self
            .layers
            .get_mut(&key.layer)
            .and_then(|v| v.iter_mut().find(|e| e.index == key.index))
        else {
            return Ok(());
        };
        match std::mem::replace(&mut e.state, State::Normal) {
            State::Encoding => self.cancel_encode(key.layer, key.index),
            State::Decoding(ct, pending) => {
                // A corrupt encoding does not matter to a tensor nobody reads.
                let _ = pending.finish(self.p.as_ref());
                e.state = State::Compressed(ct);
                Ok(())
            }
            other => {
                e.state = other;
                Ok(())
            }
        }
    }
}
