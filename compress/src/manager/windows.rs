//! [`Schedule::Windows`], MindSpeed's: the framework wraps operators in windows; a forward
//! window encodes the previous layer's tensors and a backward window decodes the next layer's,
//! as many as the cost model fits in the operator's time; what is still compressed when its
//! layer's backward starts is recovered synchronously.

use std::time::Duration;

use hprt_platform::{DeviceBuffer, Event};

use super::{ActivationManager, QueuedEncode, Schedule, State, RECORDS_KEPT};
use crate::cost::Op;
use crate::device::PendingDecode;
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use crate::key::TensorKey;
use crate::planner::{fit_window, LayerId};

/// One operator window: what was predicted and (once resolved) measured, and what ran in it.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowRecord {
    pub op: String,
    pub predicted: Option<Duration>,
    /// The operator's time on the compute stream, from events around it.
    pub measured: Option<Duration>,
    pub encoded: usize,
    pub decoded: usize,
    pub bytes: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Phase {
    Forward,
    Backward,
}

pub(super) enum Work {
    Encode(LayerId, Vec<QueuedEncode>),
    Decode(LayerId, Vec<(usize, PendingDecode)>),
}

pub(super) struct OpenWindow {
    record: usize,
    start: Event,
    work: Option<Work>,
}

impl ActivationManager {
    /// Refuses the calls of [`Schedule::Windows`] under another schedule.
    pub(super) fn windows_only(&self, what: &str) -> Result<()> {
        if self.schedule != Schedule::Windows {
            return Err(CompressError::InvalidState(format!(
                "{what}: this manager schedules {:?}, which has no operator windows or layer \
                 phases (save, take and discard drive it)",
                self.schedule
            )));
        }
        Ok(())
    }

    pub(super) fn no_window(&self, what: &str) -> Result<()> {
        if self.window.is_some() {
            return Err(CompressError::InvalidState(format!(
                "{what} while an operator window is open"
            )));
        }
        Ok(())
    }

    /// The layer's forward begins (MindSpeed's `pack_start`). Its tensors of the previous step
    /// must all have been taken.
    pub fn forward_start(&mut self, layer: LayerId) -> Result<()> {
        self.windows_only("forward_start")?;
        self.no_window("forward_start")?;
        if self.layers.get(&layer).is_some_and(|v| !v.is_empty()) {
            return Err(CompressError::InvalidState(format!(
                "layer {} still holds {} tensors from the previous step",
                layer.0,
                self.layers[&layer].len()
            )));
        }
        self.fwd.enter(layer);
        self.phase = Some(Phase::Forward);
        Ok(())
    }

    /// The layer's backward begins (MindSpeed's `unpack_start`): its tensors still compressed
    /// are decoded now, synchronously.
    pub fn backward_start(&mut self, layer: LayerId) -> Result<()> {
        self.windows_only("backward_start")?;
        self.no_window("backward_start")?;
        self.bwd.enter(layer);
        self.phase = Some(Phase::Backward);
        let idx: Vec<usize> = self
            .layers
            .get(&layer)
            .map(|v| {
                v.iter()
                    .filter(|e| matches!(e.state, State::Compressed(_)))
                    .map(|e| e.index)
                    .collect()
            })
            .unwrap_or_default();
        for i in idx {
            self.recover(layer, i)?;
        }
        Ok(())
    }

    /// Decodes one compressed tensor back into its own buffer and waits.
    fn recover(&mut self, layer: LayerId, index: usize) -> Result<()> {
        let (p, codec, side) = (self.p.clone(), self.codec.clone(), self.side.clone());
        let compute = self.compute.clone();
        let e = self.entry_mut(layer, index)?;
        if !matches!(e.state, State::Compressed(_)) {
            return Ok(());
        }
        e.reacquire(p.as_ref())?;
        let State::Compressed(ct) = &e.state else {
            unreachable!("checked above");
        };
        // Nothing on the side stream may run before the compute stream reached this point.
        let ready = p.create_event(false)?;
        p.record_event(&ready, &compute)?;
        p.stream_wait_event(&side, &ready)?;
        codec
            .decode_async(p.as_ref(), ct, e.tensor.place(), &side)?
            .finish(p.as_ref())?;
        e.state = State::Normal;
        let done = p.create_event(false)?;
        p.record_event(&done, &side)?;
        p.stream_wait_event(&self.compute, &done)?;
        self.stats.entry(layer).or_default().recovered_sync += 1;
        Ok(())
    }

    /// Before an asynchronous operator is enqueued on the compute stream: predicts its
    /// duration and starts encoding (forward) or decoding (backward) what fits.
    pub fn begin_window(&mut self, op: &Op) -> Result<()> {
        self.windows_only("begin_window")?;
        self.no_window("begin_window")?;
        let predicted = match self.cost.predict(op) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::debug!("no codec work in the window of {}: {e}", op.name());
                None
            }
        };
        let start = self.p.create_event(true)?;
        self.p.record_event(&start, &self.compute)?;
        if self.records.len() == RECORDS_KEPT {
            // A training loop opens windows forever: keep the recent ones, not every one.
            self.records.pop_front();
            self.records_dropped += 1;
            while self
                .pending_events
                .front()
                .is_some_and(|(i, ..)| *i < self.records_dropped)
            {
                self.pending_events.pop_front();
            }
        }
        let record = self.records_dropped + self.records.len();
        self.records.push_back(WindowRecord {
            op: op.name(),
            predicted: predicted.filter(|_| !matches!(op, Op::Unbounded)),
            measured: None,
            encoded: 0,
            decoded: 0,
            bytes: 0,
        });
        // Open first, so an error below still leaves a window end_window can close.
        self.window = Some(OpenWindow {
            record,
            start: start.clone(),
            work: None,
        });
        let Some(window) = predicted else {
            return Ok(());
        };
        // The side stream starts where the compute stream is now.
        self.p.stream_wait_event(&self.side, &start)?;
        let work = match self.phase {
            Some(Phase::Forward) => self.plan_encode(window)?,
            Some(Phase::Backward) => self.plan_decode(window)?,
            None => None,
        };
        if let Some(w) = self.window.as_mut() {
            w.work = work;
        }
        Ok(())
    }

    fn plan_encode(&mut self, window: Duration) -> Result<Option<Work>> {
        let Some(layer) = self.fwd.current().and_then(|c| self.fwd.prev(c)) else {
            return Ok(None);
        };
        let Some(entries) = self.layers.get(&layer) else {
            return Ok(None);
        };
        let candidates: Vec<(usize, usize)> = entries
            .iter()
            .filter(|e| matches!(e.state, State::Normal) && !e.encode_failed)
            .map(|e| (e.index, e.tensor.len))
            .collect();
        let budget = self
            .cost
            .encodable_numel(window, CodecDType::BF16)
            .saturating_mul(2);
        let plan = fit_window(&candidates, budget);
        let mut items = Vec::new();
        for index in plan {
            match self.launch_encode(layer, index) {
                Ok(q) => items.push(q),
                // Out of memory for the encoding, say: this tensor stays as it is.
                Err(err) => self.encode_failed(layer, index, err)?,
            }
        }
        Ok(Some(Work::Encode(layer, items)))
    }

    fn plan_decode(&mut self, window: Duration) -> Result<Option<Work>> {
        let Some(layer) = self.bwd.current().and_then(|c| self.bwd.next(c)) else {
            return Ok(None);
        };
        let Some(entries) = self.layers.get(&layer) else {
            return Ok(None);
        };
        let candidates: Vec<(usize, usize)> = entries
            .iter()
            .filter(|e| matches!(e.state, State::Compressed(_)))
            .map(|e| (e.index, e.tensor.len))
            .collect();
        let budget = self
            .cost
            .decodable_numel(window, CodecDType::BF16)
            .saturating_mul(2);
        let mut items = Vec::new();
        for index in fit_window(&candidates, budget) {
            let (p, codec, side) = (self.p.clone(), self.codec.clone(), self.side.clone());
            let e = self.entry_mut(layer, index)?;
            if !matches!(e.state, State::Compressed(_)) {
                continue;
            }
            // Out of memory: leave it compressed; backward_start recovers it later.
            if let Err(err) = e.reacquire(p.as_ref()) {
                tracing::debug!("cannot re-acquire a tensor of layer {}: {err}", layer.0);
                break;
            }
            let State::Compressed(ct) = &e.state else {
                unreachable!("checked above");
            };
            let pending = codec.decode_async(p.as_ref(), ct, e.tensor.place(), &side)?;
            items.push((index, pending));
        }
        Ok(Some(Work::Decode(layer, items)))
    }

    /// After the operator was enqueued: the compute stream waits for the codec work, encoded
    /// originals are freed (their compressed bytes kept) and decoded tensors become usable.
    pub fn end_window(&mut self) -> Result<()> {
        let Some(w) = self.window.take() else {
            return Err(CompressError::InvalidState(
                "end_window without begin_window".into(),
            ));
        };
        let end = self.p.create_event(true)?;
        self.p.record_event(&end, &self.compute)?;
        self.pending_events.push_back((w.record, w.start, end));
        let side_done = self.p.create_event(false)?;
        self.p.record_event(&side_done, &self.side)?;
        self.p.stream_wait_event(&self.compute, &side_done)?;
        match w.work {
            None => {}
            Some(Work::Encode(_, items)) => {
                for q in items {
                    if let Some(orig) = self.finish_encode(q)? {
                        let r = &mut self.records[w.record - self.records_dropped];
                        r.encoded += 1;
                        r.bytes += orig;
                    }
                }
            }
            Some(Work::Decode(layer, items)) => {
                let mut first_err = None;
                for (index, pending) in items {
                    let r = pending.finish(self.p.as_ref());
                    let e = self.entry_mut(layer, index)?;
                    match r {
                        Ok(()) => {
                            let bytes = e.tensor.len;
                            e.state = State::Normal;
                            self.stats.entry(layer).or_default().decoded_in_window += 1;
                            let rec = &mut self.records[w.record - self.records_dropped];
                            rec.decoded += 1;
                            rec.bytes += bytes;
                        }
                        Err(err) => {
                            first_err.get_or_insert(err);
                        }
                    }
                }
                if let Some(err) = first_err {
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// Runs `op` (whatever the closure enqueues on the compute stream) inside a window.
    pub fn window<R>(&mut self, op: &Op, f: impl FnOnce() -> R) -> Result<R> {
        self.begin_window(op)?;
        let r = f();
        self.end_window()?;
        Ok(r)
    }

    /// The last [`RECORDS_KEPT`] windows, with the measured duration of each operator (waits
    /// for the ones not yet resolved).
    pub fn window_records(&mut self) -> Result<Vec<WindowRecord>> {
        for (i, start, end) in std::mem::take(&mut self.pending_events) {
            self.p.synchronize_event(&end)?;
            let ms = self.p.event_elapsed_ms(&start, &end)?;
            self.records[i - self.records_dropped].measured =
                Some(Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3));
        }
        Ok(self.records.iter().cloned().collect())
    }

    /// [`ActivationManager::take`] under [`Schedule::Windows`]. A take of a tensor of the layer
    /// the open window is decoding ends the window first; one the window encodes is refused.
    pub(super) fn take_windowed(&mut self, key: TensorKey) -> Result<DeviceBuffer> {
        match self.window.as_ref().and_then(|w| w.work.as_ref()) {
            Some(Work::Encode(l, _)) if *l == key.layer => {
                return Err(CompressError::InvalidState(format!(
                    "take of a tensor of layer {} while an operator window encodes that layer",
                    key.layer.0
                )));
            }
            Some(Work::Decode(l, _)) if *l == key.layer => self.end_window()?,
            _ => {}
        }
        self.recover(key.layer, key.index)?;
        self.forget(key)
    }
}
