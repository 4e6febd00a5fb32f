//! The engine's reload path: re-acquiring a tensor's device memory, queueing its host → device
//! copies (and device decodes) on the reload stream, prefetching, and handing tensors back in
//! state `device` once their reloads are done.

use super::*;

impl SwapEngine {
    /// Re-acquires the device memory of the tensors in state `host` and queues host → device
    /// copies (and decodes) on the reload stream. A tensor changed since its offload, or whose
    /// storage someone else re-acquired, is an error; a failed re-acquisition (device out of
    /// memory) leaves that tensor and the rest in `host` with their host copies, so the call can
    /// be retried. Tensors in `h2d`/`device` are skipped; `d2h` (offload not finished) is an
    /// error.
    pub fn start_reload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        let mut fence = None;
        let outcome = self.reload_into(tensors, &mut fence);
        self.seal(fence, &self.h2d, outcome)
    }

    fn reload_into<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        fence: &mut Option<Fence>,
    ) -> Result<()> {
        let mut tensors: Vec<&mut SwapTensor> = tensors.into_iter().collect();
        let mut decodes = Vec::new();
        let queued = self.queue_reloads(&mut tensors, fence, &mut decodes);
        // The device decodes of the tensors queued, also when a later one failed.
        let decoded = self.decode_on_device(&mut tensors, decodes);
        queued.and(decoded)
    }

    /// The loop of [`SwapEngine::reload_into`]: the device codec's decodes are left in
    /// `decodes`, to be queued together.
    fn queue_reloads(
        &mut self,
        tensors: &mut [&mut SwapTensor],
        fence: &mut Option<Fence>,
        decodes: &mut Vec<DeferredDecode>,
    ) -> Result<()> {
        let mut reuse_waited = Waited::default();
        let mut copy_waited = Waited::default();
        for (index, t) in tensors.iter_mut().enumerate() {
            let t = &mut **t;
            match t.state {
                SwapState::Host => {}
                SwapState::NonTensor | SwapState::H2d | SwapState::Device => continue,
                SwapState::D2h => return Err(t.wrong("start_reload", "host")),
            }
            self.wait_taken_back()?;
            if let Some(current) = t.modified {
                return Err(SwapError::ModifiedSinceOffload {
                    saved: t.version_at_offload,
                    current,
                });
            }
            // The device codec's encoding comes back into a scratch buffer, allocated before
            // the storage so that running out of memory for either leaves nothing behind.
            let scratch = match &t.host {
                Some(HostCopy::Device { len, .. }) => Some(self.platform.alloc_device(*len)?),
                _ => None,
            };
            let (ready_on, undo) = self.reacquire(t)?;
            // Memory pressure is when swap runs: a step failing after the re-acquisition gives
            // the memory back, so the tensor stays in `host` with its copy, ready for a retry.
            let queued = self.queue_reload(
                t,
                ready_on,
                scratch,
                fence,
                &mut reuse_waited,
                &mut copy_waited,
            );
            match queued {
                Ok(Some(enc)) => decodes.push(DeferredDecode { index, enc, undo }),
                Ok(None) => {}
                Err(e) => {
                    self.undo_reacquire(t, undo);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Queues the device codec's decodes of one reload call with one batched launch, on the
    /// codec stream between the copies in and the reload's fence. A failure gives every one
    /// of them back to `host`, as a failed reload of each would.
    fn decode_on_device(
        &mut self,
        tensors: &mut [&mut SwapTensor],
        decodes: Vec<DeferredDecode>,
    ) -> Result<()> {
        if decodes.is_empty() {
            return Ok(());
        }
        let p: &dyn Platform = &*self.platform;
        let start = Instant::now();
        let items: Vec<DecodeItem<'_>> = decodes
            .iter()
            .map(|d| {
                let t = tensors[d.index].saved.tensor().expect("h2d holds a tensor");
                DecodeItem {
                    src: &d.enc,
                    dst: t.storage.at(t.offset),
                }
            })
            .collect();
        let pending = match &self.codec_stream {
            // After the copies in, and the reload stream (whose fence the caller waits for)
            // after the decodes.
            Some(c) => self.order_after(c, &self.h2d, false).and_then(|()| {
                let d = self.codec.decode_batch_async(p, &items, c)?;
                self.order_after(&self.h2d, c, false)?;
                Ok(d)
            }),
            None => self
                .codec
                .decode_batch_async(p, &items, &self.h2d)
                .map_err(SwapError::from),
        };
        drop(items);
        self.codec_ns
            .fetch_add(elapsed_ns(start), Ordering::Relaxed);
        match pending {
            Ok(pending) => {
                for (d, pending) in decodes.into_iter().zip(pending) {
                    tensors[d.index].check = ReloadCheck::Decode(pending);
                }
                Ok(())
            }
            Err(e) => {
                for d in decodes {
                    let t = &mut *tensors[d.index];
                    t.state = SwapState::Host;
                    t.h2d = None;
                    t.reload_charge = None;
                    self.undo_reacquire(t, d.undo);
                }
                Err(e)
            }
        }
    }

    /// Queues the reload of `t`, whose memory was just re-acquired (see `reload_into`); a
    /// device encoding's decode is returned, to be queued with the others of the call.
    fn queue_reload(
        &mut self,
        t: &mut SwapTensor,
        ready_on: Option<Stream>,
        scratch: Option<DeviceBuffer>,
        fence: &mut Option<Fence>,
        reuse_waited: &mut Waited,
        copy_waited: &mut Waited,
    ) -> Result<Option<CompressedTensor>> {
        let mut decode = None;
        {
            // A platform never hands back memory under queued work, so a reload into it needs
            // no wait and a prefetch overlaps the compute before it; a framework's caching
            // allocator does (torch's hands a block out again in its stream's order): the copy
            // then waits for the work queued on that stream so far.
            if let Some(ready_on) = ready_on {
                self.order_after(&self.h2d, &ready_on, false)?;
            }
            // The host never waited for an offload whose memory went back early: the reload
            // reads the pinned copy after it, in stream order.
            if t.handed_back {
                if let Some(d2h) = t.d2h.as_ref().filter(|f| copy_waited.first_time(f)) {
                    self.platform.stream_wait_event(&self.h2d, d2h)?;
                }
            }
            let f = match fence {
                Some(f) => Arc::clone(f),
                None => {
                    let f = self.new_fence()?;
                    *fence = Some(Arc::clone(&f));
                    f
                }
            };
            let tensor = t.saved.tensor().expect("host state holds a tensor");
            let (dst, offset, len) = (&tensor.storage, tensor.offset, tensor.len);
            let p: &dyn Platform = &*self.platform;
            let host = t.host.as_mut().expect("host state holds its copy");
            let link = match host {
                HostCopy::Plain(block) => {
                    p.copy_async(dst.into(), offset, block.buffer().into(), 0, len, &self.h2d)?;
                    block.set_last_use(&f);
                    len
                }
                HostCopy::Device { block, len: n, .. } => {
                    let scratch = scratch.expect("allocated above for a device encoding");
                    p.copy_async(
                        (&scratch).into(),
                        0,
                        block.buffer().into(),
                        0,
                        *n,
                        &self.h2d,
                    )?;
                    block.set_last_use(&f);
                    let dtype = codec_dtype(tensor.dtype).expect("compressed dtype");
                    // The encoding holds the scratch, which the platform frees after the
                    // queued decode read it.
                    decode = Some(CompressedTensor::from_device_bytes(
                        scratch,
                        *n,
                        dtype,
                        tensor.numel(),
                    )?);
                    *n
                }
                HostCopy::Staged {
                    encoded, raw_len, ..
                } => {
                    let encoded = Arc::clone(encoded.as_ref().expect("host state holds it"));
                    let raw_len = *raw_len;
                    let mut raw = self.block(raw_len, &self.h2d, reuse_waited)?;
                    let slot: Slot<()> = Arc::default();
                    let (buf, out, ns) = (
                        raw.buffer().clone(),
                        Arc::clone(&slot),
                        Arc::clone(&self.codec_ns),
                    );
                    p.launch_host_fn(
                        &self.h2d,
                        Box::new(move || {
                            let start = Instant::now();
                            // Decoded straight into the pinned block the copy takes to the
                            // device: no fresh buffer, no second pass over the bytes.
                            // SAFETY: stream order: the copy out of the block is queued after
                            // this host function on its stream, and the block's previous use
                            // finished before the pool handed it out.
                            let r = unsafe {
                                buf.with_unsynchronized_mut(0, raw_len, |out| {
                                    codec::decode_into(&encoded, out, &DecodeOptions::default())
                                })
                            }
                            .map_err(SwapError::from)
                            .and_then(|decoded| decoded.map(drop).map_err(SwapError::from));
                            ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                            *lock(&out) = Some(r);
                        }),
                    )?;
                    p.copy_async(dst.into(), offset, raw.buffer().into(), 0, len, &self.h2d)?;
                    raw.set_last_use(&f);
                    t.check = ReloadCheck::Staged(slot, raw);
                    len
                }
            };
            self.stats.reloaded_tensors += 1;
            self.stats.reloaded_bytes += len as u64;
            self.stats.link_h2d_bytes += link as u64;
            t.reload_charge = Some(Charge::new(&self.reload_inflight, len));
            let now = self.reload_inflight.load(Ordering::Acquire) as u64;
            self.stats.reload_inflight_peak = self.stats.reload_inflight_peak.max(now);
            t.h2d = Some(f);
            t.state = SwapState::H2d;
        }
        Ok(decode)
    }

    /// Gives back what [`SwapEngine::reacquire`] took for a reload that then failed: borrowed
    /// memory goes back to its framework, owned storage is resized to zero again (when this
    /// reload resized it) and counted released again.
    fn undo_reacquire(&mut self, t: &mut SwapTensor, undo: Undo) {
        match undo {
            Undo::Borrowed => release_borrowed(t, &self.empty),
            Undo::Owned { resized } => {
                let Saved::Tensor(tensor) = &t.saved else {
                    return;
                };
                if resized {
                    if let Err(e) = self.release_owned(&tensor.storage) {
                        tracing::warn!(error = %e, "a failed reload could not release its storage");
                    }
                }
                let bucket = self.released.entry(t.release_key).or_default();
                match bucket
                    .iter_mut()
                    .find(|r| r.storage.same_as(&tensor.storage))
                {
                    Some(r) => {
                        r.pending += 1;
                        r.reacquired &= !resized;
                    }
                    None => bucket.push(Released {
                        storage: tensor.storage.clone(),
                        pending: 1,
                        reacquired: !resized,
                    }),
                }
            }
        }
    }

    /// [`SwapEngine::start_reload`] for a prefetch: only the tensors that fit the reload window
    /// (see [`InflightWindow`]) start, in order; the rest stay in `host` for a later prefetch
    /// or their own load. Returns how many started (with at most one tensor of an empty
    /// window, so an oversized tensor still prefetches alone).
    pub fn prefetch<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<usize> {
        let Some(max) = self.window.reload_bytes else {
            let mut started = 0;
            let tensors: Vec<_> = tensors
                .into_iter()
                .inspect(|t| started += usize::from(t.state == SwapState::Host))
                .collect();
            self.start_reload(tensors)?;
            return Ok(started);
        };
        let mut planned = self.reload_inflight.load(Ordering::Acquire);
        let mut admitted = Vec::new();
        for t in tensors {
            if t.state != SwapState::Host {
                continue;
            }
            let n = t.swap_bytes();
            if planned > 0 && planned + n > max {
                self.stats.prefetches_deferred += 1;
                continue;
            }
            planned += n;
            admitted.push(t);
        }
        let started = admitted.len();
        self.start_reload(admitted)?;
        Ok(started)
    }

    /// Gives a released tensor device memory again: owned storage is resized back (once for all
    /// its views), borrowed memory comes from the framework's allocator. Returns the stream the
    /// allocator's memory is ready on ([`crate::Reacquired::ready_on`]).
    fn reacquire(&mut self, t: &mut SwapTensor) -> Result<(Option<Stream>, Undo)> {
        let storage_len = t.storage_len;
        let Saved::Tensor(tensor) = &mut t.saved else {
            unreachable!("host state holds a tensor")
        };
        match &tensor.origin {
            Origin::Owned => {
                let current = tensor.version.get();
                if current != t.version_at_offload {
                    return Err(SwapError::ModifiedSinceOffload {
                        saved: t.version_at_offload,
                        current,
                    });
                }
                let key = t.release_key;
                let bucket = self.released.get_mut(&key);
                let at = bucket
                    .as_ref()
                    .and_then(|b| b.iter().position(|r| r.storage.same_as(&tensor.storage)));
                let reacquired_here = match (&bucket, at) {
                    (Some(b), Some(i)) => b[i].reacquired,
                    _ => false,
                };
                let resized = tensor.storage.is_empty();
                match tensor.storage.len() {
                    0 => self.platform.resize_device(&tensor.storage, storage_len)?,
                    // Another saved view of it was reloaded first.
                    n if n == storage_len && reacquired_here => {}
                    n if n == storage_len => return Err(SwapError::ReacquiredOutsideSwap),
                    actual => {
                        return Err(SwapError::StorageResized {
                            expected: storage_len,
                            actual,
                        })
                    }
                }
                if let (Some(bucket), Some(i)) = (self.released.get_mut(&key), at) {
                    let r = &mut bucket[i];
                    r.reacquired = true;
                    r.pending -= 1;
                    if r.pending == 0 {
                        bucket.swap_remove(i);
                        if bucket.is_empty() {
                            self.released.remove(&key);
                        }
                    }
                }
                Ok((None, Undo::Owned { resized }))
            }
            Origin::Borrowed(allocator) => {
                let got = allocator.allocate(tensor)?;
                let fits = got
                    .offset
                    .checked_add(tensor.len)
                    .is_some_and(|end| end <= got.storage.len());
                if !fits {
                    return Err(SwapError::InvalidTensor(format!(
                        "the allocator gave {} bytes for a {}-byte tensor at offset {}",
                        got.storage.len(),
                        tensor.len,
                        got.offset
                    )));
                }
                tensor.storage = got.storage;
                tensor.offset = got.offset;
                tensor.handle = got.handle;
                tensor.version = got.version;
                Ok((got.ready_on, Undo::Borrowed))
            }
        }
    }

    /// Makes `compute` wait for the reloads of the tensors in state `h2d` (no host
    /// synchronization, except for compressed payloads, whose decode is checked on the host)
    /// and hands them back in state `device`; their host copies are dropped. A failed decode
    /// leaves the tensor in `host` with its copy. Tensors in `device` are skipped; `d2h`/`host`
    /// are errors.
    pub fn finish_reload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
    ) -> Result<()> {
        let mut waited = Waited::default();
        for t in tensors {
            match t.state {
                SwapState::H2d => {}
                SwapState::NonTensor | SwapState::Device => continue,
                SwapState::D2h | SwapState::Host => return Err(t.wrong("finish_reload", "h2d")),
            }
            let fence = Arc::clone(t.h2d.as_ref().expect("h2d state holds its fence"));
            let checked = match std::mem::take(&mut t.check) {
                ReloadCheck::None => Ok(()),
                ReloadCheck::Decode(pending) => pending.finish(&*self.platform).map_err(Into::into),
                ReloadCheck::Staged(slot, _raw) => {
                    self.platform.synchronize_event(&fence)?;
                    take(&slot).unwrap_or_else(|| {
                        Err(SwapError::Order("the host-stage decode did not run".into()))
                    })
                }
            };
            if let Err(e) = checked {
                t.h2d = None;
                t.state = SwapState::Host;
                return Err(e);
            }
            if !self.faults.skip_reload_wait && waited.first_time(&fence) {
                self.platform.stream_wait_event(compute, &fence)?;
            }
            t.h2d = None;
            t.host = None;
            t.d2h = None;
            t.handed_back = false;
            t.reload_charge = None;
            t.state = SwapState::Device;
            // The compute stream waits for the copy: the memory is the framework's from now on
            // (hprt keeps only the handle the front end hands out). No stream to record: every
            // use and the free come after that wait in the compute stream's order (recording the
            // reload stream would hold the block until the later prefetches queued there ran).
            if let Some(tensor) = t.saved.tensor() {
                self.hand_over(tensor, &[]);
            }
        }
        Ok(())
    }
}
