//! The checked layer between `hprt-sys` (ACL loaded at run time) and the backend, in the cuda
//! backend's shape (`cuda/result.rs`): each ACL stream, event and memory call the backend makes,
//! once, returning the crate's typed [`Error`], over typed handles instead of pointers cast to
//! `usize`.
//!
//! Handles are identifiers (`Copy`); [`super::StreamObj`], [`super::EventObj`] and buffers
//! (`auxil::uses`) own them and destroy them once, so destroying calls are `unsafe`. ACL keeps
//! the device per thread: callers bind it first (`Shared::bind`). HCCL calls stay in
//! `collective.rs` behind `check::hccl` (on a typed [`Comm`]); host functions in `host_fn.rs`.

use std::ffi::c_void;

use hprt_sys::types::{
    aclrtEvent, aclrtEventRecordedStatus, aclrtMemAttr, aclrtMemMallocPolicy, aclrtMemcpyKind,
    aclrtStream, aclrtStreamStatus, HcclComm,
};
use hprt_sys::Ascend;

use super::check::acl;
use crate::error::Result;

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident($raw:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct $name($raw);
        // SAFETY: an ACL handle is an identifier ACL accepts from any thread bound to its
        // device.
        unsafe impl Send for $name {}
        // SAFETY: `&self` only copies the identifier out; the ACL and HCCL calls made with it
        // are thread-safe, and the owning object (not this handle) decides when it is destroyed.
        unsafe impl Sync for $name {}
    };
}

handle!(
    /// An ACL stream: created here, or a framework's, wrapped.
    Stream(aclrtStream)
);
handle!(
    /// An ACL event.
    Event(aclrtEvent)
);
handle!(
    /// An HCCL communicator; `CommObj` owns it and destroys it once.
    Comm(HcclComm)
);

impl Comm {
    pub(crate) fn from_sys(c: HcclComm) -> Self {
        Comm(c)
    }
    pub(crate) fn sys(self) -> HcclComm {
        self.0
    }
}

impl Stream {
    /// The `sys` handle, for calls this layer does not wrap (HCCL's).
    pub(crate) fn sys(self) -> aclrtStream {
        self.0
    }
    /// The handle value frameworks exchange ([`crate::RawStream`]), and streams are keyed by.
    pub(crate) fn addr(self) -> usize {
        self.0 as usize
    }
    /// The stream behind a framework's handle value.
    ///
    /// # Safety
    /// `raw` must be a live ACL stream.
    pub(crate) unsafe fn from_raw(raw: usize) -> Self {
        Stream(raw as aclrtStream)
    }
}

pub(crate) mod stream {
    use super::*;

    pub(crate) fn create(api: &Ascend) -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        acl(
            // SAFETY: the out-pointer is a live local `aclrtStream`; `api` holds the library
            // loaded, so the function pointer is valid.
            unsafe { api.acl.aclrtCreateStream(&mut s) },
            "aclrtCreateStream",
        )?;
        Ok(Stream(s))
    }

    /// # Safety
    /// A stream from [`create`], destroyed once (ACL lets queued work finish).
    pub(crate) unsafe fn destroy(api: &Ascend, s: Stream) -> Result<()> {
        acl(
            // SAFETY: the caller's contract: `s` is a stream of ours, destroyed this once.
            unsafe { api.acl.aclrtDestroyStream(s.0) },
            "aclrtDestroyStream",
        )
    }

    pub(crate) fn synchronize(api: &Ascend, s: Stream) -> Result<()> {
        // SAFETY: a live stream.
        acl(
            unsafe { api.acl.aclrtSynchronizeStream(s.0) },
            "aclrtSynchronizeStream",
        )
    }

    /// Whether everything queued on `s` finished; `None` when this ACL lacks
    /// `aclrtStreamQuery`.
    pub(crate) fn query(api: &Ascend, s: Stream) -> Option<Result<bool>> {
        api.acl.aclrtStreamQuery.as_ref().ok()?;
        let mut status = aclrtStreamStatus(0xFFFF);
        // SAFETY: a live stream; plain ACL call into a local.
        let r = acl(
            unsafe { api.acl.aclrtStreamQuery(s.0, &mut status) },
            "aclrtStreamQuery",
        );
        Some(r.map(|()| status == aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE))
    }

    pub(crate) fn wait_event(api: &Ascend, s: Stream, e: Event) -> Result<()> {
        // SAFETY: a live stream and event.
        acl(
            unsafe { api.acl.aclrtStreamWaitEvent(s.0, e.0) },
            "aclrtStreamWaitEvent",
        )
    }
}

pub(crate) mod event {
    use super::*;

    pub(crate) fn create(api: &Ascend, flags: u32) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        acl(
            // SAFETY: the out-pointer is a live local `aclrtEvent`; ACL checks `flags`.
            unsafe { api.acl.aclrtCreateEventWithFlag(&mut e, flags) },
            "aclrtCreateEventWithFlag",
        )?;
        Ok(Event(e))
    }

    /// # Safety
    /// An event from [`create`], destroyed once, no longer waited on.
    pub(crate) unsafe fn destroy(api: &Ascend, e: Event) {
        // SAFETY: the caller's contract: `e` is an event of ours, destroyed this once and no
        // longer waited on.
        unsafe { api.acl.aclrtDestroyEvent(e.0) };
    }

    pub(crate) fn record(api: &Ascend, e: Event, s: Stream) -> Result<()> {
        // SAFETY: a live event and stream.
        acl(
            unsafe { api.acl.aclrtRecordEvent(e.0, s.0) },
            "aclrtRecordEvent",
        )
    }

    /// Whether the work before the event's last record finished.
    pub(crate) fn query(api: &Ascend, e: Event) -> Result<bool> {
        let mut status = aclrtEventRecordedStatus(0);
        acl(
            // SAFETY: `e` is live (its `EventObj` owns it for the duration of the call); the
            // out-pointer is a live local.
            unsafe { api.acl.aclrtQueryEventStatus(e.0, &mut status) },
            "aclrtQueryEventStatus",
        )?;
        Ok(status.0 == 1)
    }

    pub(crate) fn synchronize(api: &Ascend, e: Event) -> Result<()> {
        // SAFETY: a live event.
        acl(
            unsafe { api.acl.aclrtSynchronizeEvent(e.0) },
            "aclrtSynchronizeEvent",
        )
    }

    pub(crate) fn elapsed_ms(api: &Ascend, start: Event, end: Event) -> Result<f32> {
        let mut ms = 0f32;
        acl(
            // SAFETY: both events are live (their `EventObj`s own them for the duration of
            // the call); the out-pointer is a live local.
            unsafe { api.acl.aclrtEventElapsedTime(&mut ms, start.0, end.0) },
            "aclrtEventElapsedTime",
        )?;
        Ok(ms)
    }
}

pub(crate) mod mem {
    use super::*;

    /// `bytes` of device memory on the bound device.
    pub(crate) fn alloc(api: &Ascend, bytes: usize) -> Result<usize> {
        let mut p = std::ptr::null_mut();
        acl(
            // SAFETY: the out-pointer is a live local; ACL checks the size and the policy (0:
            // `ACL_MEM_MALLOC_HUGE_FIRST`).
            unsafe { api.acl.aclrtMalloc(&mut p, bytes, aclrtMemMallocPolicy(0)) },
            "aclrtMalloc",
        )?;
        Ok(p as usize)
    }

    /// # Safety
    /// Memory from [`alloc`], freed once, no queued work using it.
    pub(crate) unsafe fn free(api: &Ascend, p: usize) -> Result<()> {
        // SAFETY: the caller's contract: `p` came from `alloc`, is freed this once, and no
        // queued work uses it.
        acl(unsafe { api.acl.aclrtFree(p as *mut c_void) }, "aclrtFree")
    }

    /// `bytes` of page-locked host memory.
    pub(crate) fn alloc_host(api: &Ascend, bytes: usize) -> Result<usize> {
        let mut p = std::ptr::null_mut();
        acl(
            // SAFETY: the out-pointer is a live local; ACL checks the size.
            unsafe { api.acl.aclrtMallocHost(&mut p, bytes) },
            "aclrtMallocHost",
        )?;
        Ok(p as usize)
    }

    /// # Safety
    /// Memory from [`alloc_host`], freed once, no queued work using it.
    pub(crate) unsafe fn free_host(api: &Ascend, p: usize) -> Result<()> {
        acl(
            // SAFETY: the caller's contract: `p` came from `alloc_host`, is freed this once, and
            // no queued work uses it.
            unsafe { api.acl.aclrtFreeHost(p as *mut c_void) },
            "aclrtFreeHost",
        )
    }

    /// Queues a copy of `bytes` into `dst`, of which `dst_max` bytes remain.
    ///
    /// # Safety
    /// Both ranges are live memory that stays so until the copy ran.
    pub(crate) unsafe fn copy_async(
        api: &Ascend,
        dst: usize,
        dst_max: usize,
        src: usize,
        bytes: usize,
        kind: aclrtMemcpyKind,
        s: Stream,
    ) -> Result<()> {
        acl(
            // SAFETY: the caller's contract: both ranges stay live until the copy ran on `s`;
            // ACL itself refuses `bytes > dst_max`.
            unsafe {
                api.acl.aclrtMemcpyAsync(
                    dst as *mut c_void,
                    dst_max,
                    src as *const c_void,
                    bytes,
                    kind,
                    s.0,
                )
            },
            "aclrtMemcpyAsync",
        )
    }

    /// # Safety
    /// `dst..dst + bytes` is live device memory (`dst_max` bytes remain) that stays so until
    /// the memset ran.
    pub(crate) unsafe fn set_async(
        api: &Ascend,
        dst: usize,
        dst_max: usize,
        value: u8,
        bytes: usize,
        s: Stream,
    ) -> Result<()> {
        acl(
            // SAFETY: the caller's contract: `dst..dst + bytes` is live device memory until the
            // memset ran on `s`; ACL itself refuses `bytes > dst_max`.
            unsafe {
                api.acl
                    .aclrtMemsetAsync(dst as *mut c_void, dst_max, i32::from(value), bytes, s.0)
            },
            "aclrtMemsetAsync",
        )
    }

    /// Free and total bytes of the bound device's HBM.
    pub(crate) fn info(api: &Ascend) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0, 0);
        acl(
            // SAFETY: both out-pointers are live locals; attribute 1 is `ACL_HBM_MEM`.
            unsafe {
                api.acl
                    .aclrtGetMemInfo(aclrtMemAttr(1), &mut free, &mut total)
            },
            "aclrtGetMemInfo",
        )?;
        Ok((free, total))
    }
}
