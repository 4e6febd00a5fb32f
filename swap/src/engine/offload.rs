//! The engine's offload path: device → host copies (compressed on the device or the host) on
//! the offload stream, within the in-flight window, and their completion or cancellation.

use super::*;

impl SwapEngine {
    /// Queues device → host copies of the tensors in state `device` (compressed where their
    /// compression says so), after the work queued on `compute` so far. Tensors already
    /// offloaded (`d2h`, `host`) are skipped; `h2d` is an error.
    pub fn offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
    ) -> Result<()> {
        let mut batch = OpenBatch::default();
        let outcome = self.offload_into(tensors, compute, &mut batch);
        self.close_batch(&mut batch, outcome)
    }

    /// Records the open batch's fence after its copies and counts it in flight, then reports
    /// `outcome` (tensors that got a copy before a failure hold a fence that covers it).
    fn close_batch(&mut self, batch: &mut OpenBatch, outcome: Result<()>) -> Result<()> {
        let Some(f) = batch.fence.take() else {
            return outcome;
        };
        self.platform.record_event(&f, &self.d2h)?;
        self.offloads_in_flight
            .push_back((f, std::mem::take(&mut batch.bytes)));
        self.note_offload_peak();
        outcome
    }

    /// Bytes of the offload batches in flight (a few batches: summed when asked).
    pub(super) fn offload_inflight_bytes(&self) -> usize {
        self.offloads_in_flight.iter().map(|(_, n)| n).sum()
    }

    fn note_offload_peak(&mut self) {
        let now = self.offload_inflight_bytes() as u64;
        self.stats.offload_inflight_peak = self.stats.offload_inflight_peak.max(now);
    }

    /// Forgets the offload batches whose copies finished (never blocks).
    fn retire_offloads(&mut self) -> Result<()> {
        while let Some((f, _)) = self.offloads_in_flight.front() {
            if !self.platform.query_event(f)? {
                break;
            }
            self.offloads_in_flight.pop_front();
        }
        Ok(())
    }

    /// Makes room for `bytes` more of offloads in the window: waits on the host for the
    /// oldest batches (closing the open one first when it is all there is to wait for). An
    /// offload larger than the whole window goes alone.
    fn make_room(&mut self, bytes: usize, batch: &mut OpenBatch) -> Result<()> {
        self.retire_offloads()?;
        let Some(max) = self.window.offload_bytes else {
            return Ok(());
        };
        loop {
            let inflight = self.offload_inflight_bytes() + batch.bytes;
            if inflight == 0 || inflight + bytes <= max {
                return Ok(());
            }
            if self.offloads_in_flight.is_empty() {
                self.close_batch(batch, Ok(()))?;
            }
            let (f, _) = self
                .offloads_in_flight
                .pop_front()
                .expect("the open batch was just closed");
            self.platform.synchronize_event(&f)?;
            self.stats.offload_window_waits += 1;
        }
    }

    fn offload_into<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
        batch: &mut OpenBatch,
    ) -> Result<()> {
        let mut reuse_waited = Waited::default();
        let mut tensors: Vec<&mut SwapTensor> = tensors.into_iter().collect();
        // How each tensor to offload travels, decided once (a policy may be the framework's).
        let mut modes = Vec::with_capacity(tensors.len());
        for t in &tensors {
            modes.push(match t.state {
                SwapState::Device => {
                    let tensor = t.saved.tensor().expect("device state holds a tensor");
                    Some(self.compression_for(tensor))
                }
                SwapState::NonTensor | SwapState::D2h | SwapState::Host => None,
                SwapState::H2d => return Err(t.wrong("offload", "device")),
            });
        }
        // Device-codec encodings of the tensors ahead, by index: made a chunk at a time.
        let mut encoded: HashMap<usize, Encoded> = HashMap::new();
        for i in 0..tensors.len() {
            let Some(mode) = modes[i] else { continue };
            if mode == Compression::Device && !encoded.contains_key(&i) {
                self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)?;
                encoded = self.encode_chunk_on_device(&tensors, &modes, i)?;
            }
            let t = &mut *tensors[i];
            self.make_room(t.swap_bytes(), batch)?;
            let f = match &batch.fence {
                Some(f) => Arc::clone(f),
                None => {
                    self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)?;
                    let f = self.new_fence()?;
                    batch.fence = Some(Arc::clone(&f));
                    f
                }
            };
            let tensor = t.saved.tensor().expect("device state holds a tensor");
            let version = tensor.version.get();
            // (A device-coded tensor always has its encoding made ahead.)
            let mut host = match (encoded.remove(&i), mode) {
                (Some(e), _) => self.copy_encoding(e, &mut reuse_waited)?,
                (None, Compression::HostStage) => self.encode_on_host(tensor, &mut reuse_waited)?,
                (None, _) => HostCopy::Plain(self.copy_raw(tensor, &mut reuse_waited)?),
            };
            if let Some(b) = host.block_mut() {
                b.set_last_use(&f);
            }
            self.stats.offloaded_tensors += 1;
            self.stats.offloaded_bytes += tensor.len as u64;
            self.stats.link_d2h_bytes += host.link_bytes() as u64;
            batch.bytes += tensor.len;
            t.version_at_offload = version;
            // Released storages are keyed by the address they had: unique among live storages,
            // and the same for every view offloaded while it is live.
            t.release_key = tensor.storage.device_ptr();
            t.modified = None;
            t.host = Some(host);
            t.d2h = Some(f);
            t.state = SwapState::D2h;
            // The copy is queued: a framework that orders its memory's reuse after the copy
            // stream takes the memory back now, not when the host later sees the copy done.
            if self.hand_over(tensor, &[&self.d2h]) {
                release_borrowed(t, &self.empty);
                t.handed_back = true;
                self.stats.handed_back_tensors += 1;
            }
        }
        Ok(())
    }

    /// Asks a borrowed tensor's framework to take its memory back, ordered after `streams`
    /// (see [`crate::Allocator::hand_over`]); a failure is logged and leaves the memory with
    /// the engine, which releases it the usual way.
    pub(super) fn hand_over(&self, tensor: &DeviceTensor, streams: &[&Stream]) -> bool {
        let Origin::Borrowed(alloc) = &tensor.origin else {
            return false;
        };
        alloc.hand_over(tensor, streams).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the framework could not take its memory back early");
            false
        })
    }

    /// Encodes, with one batched launch sequence on the device codec, the device-coded tensors
    /// from `first` on, as many as fit [`ENCODE_SCRATCH_BYTES`] of scratch (at least one), and
    /// waits on the host once for their lengths, which size the copies.
    fn encode_chunk_on_device(
        &mut self,
        tensors: &[&mut SwapTensor],
        modes: &[Option<Compression>],
        first: usize,
    ) -> Result<HashMap<usize, Encoded>> {
        let p: &dyn Platform = &*self.platform;
        let start = Instant::now();
        let mut chunk = Vec::new(); // (index, tensor, dtype, numel, scratch)
        let mut scratch_bytes = 0;
        for (i, t) in tensors.iter().enumerate().skip(first) {
            if modes[i] != Some(Compression::Device) {
                continue;
            }
            let tensor = t.saved.tensor().expect("device state holds a tensor");
            let dtype = codec_dtype(tensor.dtype).expect("compression_for checked the dtype");
            let numel = tensor.numel();
            let max = self.codec.max_encoded_len(dtype, numel);
            if !chunk.is_empty() && scratch_bytes + max > ENCODE_SCRATCH_BYTES {
                break;
            }
            scratch_bytes += max;
            chunk.push((i, tensor, dtype, numel, p.alloc_device(max)?));
        }
        let stream = match &self.codec_stream {
            // After the producer, which the offload stream already waits for.
            Some(c) => {
                self.order_after(c, &self.d2h, false)?;
                c
            }
            None => &self.d2h,
        };
        let items: Vec<EncodeItem<'_>> = chunk
            .iter()
            .map(|(_, t, dtype, numel, scratch)| EncodeItem {
                src: t.storage.at(t.offset),
                dtype: *dtype,
                numel: *numel,
                scratch,
            })
            .collect();
        let pending = self.codec.encode_batch_async(p, &items, stream)?;
        drop(items);
        let mut encoded = HashMap::with_capacity(chunk.len());
        // The host waits for the encodes (once: they share a stream), so the copies queued
        // from them read complete encodings.
        for ((i, _, _, _, scratch), pending) in chunk.into_iter().zip(pending) {
            let len = pending.wait_len(p)?;
            encoded.insert(i, Encoded { scratch, len });
        }
        self.codec_ns
            .fetch_add(elapsed_ns(start), Ordering::Relaxed);
        Ok(encoded)
    }

    /// Queues the copy of a device encoding alone into a pinned block.
    fn copy_encoding(&mut self, e: Encoded, waited: &mut Waited) -> Result<HostCopy> {
        let Encoded { scratch, len } = e;
        let block = self.block(size_class(len), &self.d2h, waited)?;
        self.platform.copy_async(
            block.buffer().into(),
            0,
            (&scratch).into(),
            0,
            len,
            &self.d2h,
        )?;
        // Dropped now: the platform frees it after the queued copy read it.
        drop(scratch);
        self.stats.compressed_tensors += 1;
        self.stats.compressed_bytes += len as u64;
        Ok(HostCopy::Device { block, len })
    }

    /// A pinned block with `t`'s raw bytes copied in, in order on the D2H stream.
    fn copy_raw(&self, t: &DeviceTensor, waited: &mut Waited) -> Result<PinnedBlock> {
        let block = self.block(t.len, &self.d2h, waited)?;
        self.platform.copy_async(
            block.buffer().into(),
            0,
            (&t.storage).into(),
            t.offset,
            t.len,
            &self.d2h,
        )?;
        Ok(block)
    }

    /// Copies the raw bytes into a pinned staging block and encodes them on a host thread in
    /// stream order; the staging block goes back to the pool once the encoding is taken.
    fn encode_on_host(&mut self, t: &DeviceTensor, waited: &mut Waited) -> Result<HostCopy> {
        let dtype = codec_dtype(t.dtype).expect("compression_for checked the dtype");
        let staging = self.copy_raw(t, waited)?;
        let slot: Slot<Vec<u8>> = Arc::default();
        let (buf, out, ns) = (
            staging.buffer().clone(),
            Arc::clone(&slot),
            Arc::clone(&self.codec_ns),
        );
        let raw_len = t.len;
        self.platform.launch_host_fn(
            &self.d2h,
            Box::new(move || {
                let start = Instant::now();
                // Encoded where the copy left the bytes: no copy out of the block, and no
                // fresh buffer for it to fault in page by page.
                // SAFETY: stream order: the copy into the block, queued before this host
                // function on its stream, finished, and nothing queued after it has started.
                let r = unsafe {
                    buf.with_unsynchronized(0, raw_len, |raw| {
                        codec::encode(dtype, raw, &EncodeOptions::default())
                    })
                }
                .map_err(SwapError::from)
                .and_then(|encoded| encoded.map_err(SwapError::from));
                ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                *lock(&out) = Some(r);
            }),
        )?;
        Ok(HostCopy::Staged {
            staging: Some(staging),
            slot,
            encoded: None,
            raw_len,
        })
    }

    /// Waits (on the host) for the offloads of the tensors in state `d2h`, then releases their
    /// device memory (owned: resized to zero; borrowed: every reference dropped, so the
    /// framework gets it back). Tensors already in `host` are skipped; `device`/`h2d` are errors.
    /// A tensor whose memory its framework took back when the offload was queued needs no host
    /// wait (its reload waits for the copy on the reload stream), except a host-stage one,
    /// whose encoding the host collects.
    pub fn finish_offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        let mut synced = Waited::default();
        for t in tensors {
            match t.state {
                SwapState::D2h => {}
                SwapState::NonTensor | SwapState::Host => continue,
                SwapState::Device | SwapState::H2d => return Err(t.wrong("finish_offload", "d2h")),
            }
            let staged = matches!(t.host, Some(HostCopy::Staged { .. }));
            let fence = t.d2h.as_ref().expect("d2h state holds its fence");
            if (staged || !t.handed_back) && synced.first_time(fence) {
                self.platform.synchronize_event(fence)?;
            }
            if let (false, Saved::Tensor(tensor)) = (t.handed_back, &t.saved) {
                if matches!(tensor.origin, Origin::Owned) {
                    // First, so that a refusal (a view of the memory is alive) leaves the
                    // tensor in `d2h`, to be finished again once the view is gone.
                    self.release_owned(&tensor.storage)?;
                }
            }
            self.keep_host_copy(t);
            if t.handed_back {
                t.state = SwapState::Host;
                continue;
            }
            let Saved::Tensor(tensor) = &mut t.saved else {
                unreachable!("d2h state holds a tensor")
            };
            // A write that raced the copy may have torn it: the reload reports it.
            let now = tensor.version.get();
            if now != t.version_at_offload {
                t.modified = Some(now);
            }
            match tensor.origin {
                Origin::Owned => {
                    let key = t.release_key;
                    let bucket = self.released.entry(key).or_default();
                    match bucket
                        .iter_mut()
                        .find(|r| r.storage.same_as(&tensor.storage))
                    {
                        Some(r) => r.pending += 1,
                        None => bucket.push(Released {
                            storage: tensor.storage.clone(),
                            pending: 1,
                            reacquired: false,
                        }),
                    }
                }
                Origin::Borrowed(_) => release_borrowed(t, &self.empty),
            }
            t.state = SwapState::Host;
        }
        Ok(())
    }

    /// Waits on the host for the offload copies of the tensors in state `d2h` (once per batch),
    /// without releasing anything: how a front end keeps its schedule's bound on the copies in
    /// flight when their memory already went back to the framework, which cannot reuse it
    /// before the copies finished (device memory is still taken until then).
    pub fn wait_copies<'a>(&self, tensors: impl IntoIterator<Item = &'a SwapTensor>) -> Result<()> {
        let mut synced = Waited::default();
        for t in tensors {
            if let (SwapState::D2h, Some(f)) = (t.state, &t.d2h) {
                if synced.first_time(f) {
                    self.platform.synchronize_event(f)?;
                }
            }
        }
        Ok(())
    }

    /// After the offload completed: the host stage's encoding replaces its staging block (the
    /// raw bytes stay if the encode failed, so nothing is lost).
    fn keep_host_copy(&mut self, t: &mut SwapTensor) {
        let Some(HostCopy::Staged {
            staging,
            slot,
            encoded,
            ..
        }) = t.host.as_mut()
        else {
            return;
        };
        match take(slot) {
            Some(Ok(bytes)) => {
                self.stats.compressed_tensors += 1;
                self.stats.compressed_bytes += bytes.len() as u64;
                *encoded = Some(Arc::new(bytes));
                *staging = None;
            }
            failed => {
                if let Some(Err(e)) = failed {
                    tracing::warn!(error = %e, "host-stage encode failed; keeping raw bytes");
                }
                let block = staging.take().expect("staged offload holds its block");
                t.host = Some(HostCopy::Plain(block));
            }
        }
    }

    /// Takes back tensors whose offload is still queued (`d2h`) without copying: their device
    /// bytes were never released. Their host blocks return to the pool, to be reused only after
    /// the queued copy, and the next reload waits for that copy before it allocates (see the
    /// ordering rules on [`SwapEngine`]). Tensors in `device` are skipped; `host`/`h2d` are
    /// errors. A tensor whose memory its framework already took back cannot be taken back: it
    /// goes to `host` (as [`SwapEngine::finish_offload`] does), for the caller's reload.
    pub fn cancel_offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        for t in tensors {
            match t.state {
                SwapState::D2h => {}
                SwapState::NonTensor | SwapState::Device => continue,
                SwapState::Host | SwapState::H2d => return Err(t.wrong("cancel_offload", "d2h")),
            }
            if t.handed_back {
                self.finish_offload([t])?;
                continue;
            }
            if let Some(f) = t.d2h.take() {
                if !self.taken_back.iter().any(|w| Arc::ptr_eq(w, &f)) {
                    self.taken_back.push(f);
                }
            }
            t.host = None;
            t.state = SwapState::Device;
        }
        Ok(())
    }

    /// Waits for the copies of the offloads taken back since the last reload (the memory they
    /// read stays device memory until they finished).
    pub(super) fn wait_taken_back(&mut self) -> Result<()> {
        if self.faults.skip_taken_back_wait {
            self.taken_back.clear();
        }
        while let Some(f) = self.taken_back.last() {
            self.platform.synchronize_event(f)?;
            self.taken_back.pop();
        }
        Ok(())
    }
}
