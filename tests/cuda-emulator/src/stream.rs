//! Streams (one worker thread each, `hprt_emulator_common::worker`, with `HP_EMU_DELAY_SEED`
//! delays), events with timing, and host functions.
//!
//! The null stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` all name the current
//! context's default stream; the emulator does not model the legacy stream's implicit
//! synchronisation with blocking streams (hprt creates only non-blocking ones). A job's error is
//! the stream's asynchronous error: the next `cuStreamSynchronize` (or `cuCtxSynchronize`)
//! returns and clears it. An event record carries the stream's error as of that point, so
//! `cuEventSynchronize` returns it and a stream that waits on the record takes it as its own:
//! the error reaches all work ordered after the failure, as a GPU's sticky errors do. Unlike a
//! GPU, the error is per stream and cleared once reported, not sticky for the whole context
//! (hprt's tests then go on in the same process). Functions queued with `cuLaunchHostFunc` run
//! on the worker with driver calls forbidden (`CUDA_ERROR_NOT_PERMITTED`), as CUDA documents.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Instant;

use hprt_emulator_common::mark::{elapsed_ms, Latest};
use hprt_emulator_common::worker::Worker;

use crate::codes::*;
use crate::context;
use crate::state::{self, cu_entry, decode, encode, lock, put, EVENT_TAG, STREAM_TAG};

pub(crate) type Job = Box<dyn FnOnce() -> Result<(), CuResult> + Send + 'static>;

pub(crate) struct Stream {
    pub ctx: u64,
    worker: Arc<Worker>,
}

impl Stream {
    fn start(ctx: u64) -> Result<Arc<Stream>, CuResult> {
        let worker = Worker::start(
            state::next_id(),
            "hp-cuda-emu-stream",
            state::config().delay_seed,
            CUDA_ERROR_LAUNCH_FAILED as i32,
        )
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok(Arc::new(Stream { ctx, worker }))
    }

    pub(crate) fn enqueue(&self, job: Job) {
        self.worker
            .enqueue(Box::new(move || job().map_err(|c| c as i32)));
    }

    pub(crate) fn synchronize(&self) -> Result<(), CuResult> {
        self.worker.synchronize().map_err(|c| c as CuResult)
    }
}

#[derive(Default)]
struct Streams {
    live: HashMap<u64, Arc<Stream>>,
    /// context id → its default stream
    defaults: HashMap<u64, Arc<Stream>>,
}

fn streams() -> MutexGuard<'static, Streams> {
    static STREAMS: LazyLock<Mutex<Streams>> = LazyLock::new(Default::default);
    lock(&STREAMS)
}

fn is_default(h: *mut c_void) -> bool {
    matches!(h as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD)
}

/// The stream a handle names (a default handle: the current context's default stream).
pub(crate) fn resolve(h: *mut c_void) -> Result<Arc<Stream>, CuResult> {
    if is_default(h) {
        let ctx = context::current()?;
        let mut s = streams();
        if let Some(d) = s.defaults.get(&ctx.id) {
            return Ok(d.clone());
        }
        let d = Stream::start(ctx.id)?;
        s.defaults.insert(ctx.id, d.clone());
        return Ok(d);
    }
    let id = decode(STREAM_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let s = streams()
        .live
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if !context::alive(s.ctx) {
        return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
    }
    Ok(s)
}

/// [`resolve`], refusing a stream of another context than the current one
/// (`CUDA_ERROR_INVALID_CONTEXT`), as work queued on it would run in the wrong context.
pub(crate) fn resolve_current(h: *mut c_void) -> Result<Arc<Stream>, CuResult> {
    let ctx = context::current()?;
    let s = resolve(h)?;
    if s.ctx != ctx.id {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    Ok(s)
}

pub(crate) fn live() -> u64 {
    streams().live.len() as u64
}

pub(crate) fn synchronize_context(ctx: u64) -> Result<(), CuResult> {
    let all: Vec<Arc<Stream>> = {
        let s = streams();
        s.live
            .values()
            .chain(s.defaults.values())
            .filter(|s| s.ctx == ctx)
            .cloned()
            .collect()
    };
    let mut first = Ok(());
    for s in all {
        if let Err(e) = s.synchronize() {
            first = first.and(Err(e));
        }
    }
    first
}

/// Closes the streams of a destroyed context; returns how many the caller had created.
pub(crate) fn destroy_context(ctx: u64) -> u64 {
    let mut s = streams();
    if let Some(d) = s.defaults.remove(&ctx) {
        d.worker.close();
    }
    let dead: Vec<u64> = s
        .live
        .iter()
        .filter(|(_, st)| st.ctx == ctx)
        .map(|(id, _)| *id)
        .collect();
    for id in &dead {
        if let Some(st) = s.live.remove(id) {
            st.worker.close();
        }
    }
    dead.len() as u64
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: u32) -> CuResult {
    cu_entry("cuStreamCreate", || {
        let ctx = context::current()?;
        if out.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = Stream::start(ctx.id)?;
        let id = s.worker.id;
        streams().live.insert(id, s);
        // SAFETY: checked non-null.
        unsafe {
            put(
                out,
                encode(STREAM_TAG, id) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

/// Queued work still runs; the handle is dead at once. Default streams cannot be destroyed.
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(h: *mut c_void) -> CuResult {
    cu_entry("cuStreamDestroy_v2", || {
        let id = decode(STREAM_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let s = streams()
            .live
            .remove(&id)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.worker.close();
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(h: *mut c_void) -> CuResult {
    cu_entry("cuStreamSynchronize", || resolve(h)?.synchronize())
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(h: *mut c_void) -> CuResult {
    cu_entry("cuStreamQuery", || {
        if resolve(h)?.worker.idle() {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(h: *mut c_void, pctx: *mut *mut c_void) -> CuResult {
    cu_entry("cuStreamGetCtx", || {
        let s = resolve(h)?;
        // SAFETY: API contract.
        unsafe {
            put(
                pctx,
                encode(state::CTX_TAG, s.ctx) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    h: *mut c_void,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    user: *mut c_void,
) -> CuResult {
    cu_entry("cuLaunchHostFunc", || {
        let s = resolve_current(h)?;
        let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let user = user as usize;
        s.enqueue(Box::new(move || {
            state::IN_HOST_FN.with(|c| c.set(true));
            // SAFETY: the caller's function with its own argument, as the API defines.
            unsafe { f(user as *mut c_void) };
            state::IN_HOST_FN.with(|c| c.set(false));
            Ok(())
        }));
        Ok(())
    })
}

// ---- events ---------------------------------------------------------------------------------

struct Event {
    ctx: u64,
    flags: u32,
    latest: Latest,
}

fn events() -> MutexGuard<'static, HashMap<u64, Arc<Event>>> {
    static EVENTS: LazyLock<Mutex<HashMap<u64, Arc<Event>>>> = LazyLock::new(Default::default);
    lock(&EVENTS)
}

fn event(h: *mut c_void) -> Result<Arc<Event>, CuResult> {
    let id = decode(EVENT_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    events().get(&id).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn live_events() -> u64 {
    events().len() as u64
}

pub(crate) fn destroy_context_events(ctx: u64) -> u64 {
    let mut e = events();
    let before = e.len();
    e.retain(|_, ev| ev.ctx != ctx);
    (before - e.len()) as u64
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, flags: u32) -> CuResult {
    cu_entry("cuEventCreate", || {
        let ctx = context::current()?;
        let known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
        if out.is_null()
            || flags & !known != 0
            || (flags & CU_EVENT_INTERPROCESS != 0 && flags & CU_EVENT_DISABLE_TIMING == 0)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = state::next_id();
        events().insert(
            id,
            Arc::new(Event {
                ctx: ctx.id,
                flags,
                latest: Latest::default(),
            }),
        );
        // SAFETY: checked non-null.
        unsafe {
            put(
                out,
                encode(EVENT_TAG, id) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(h: *mut c_void) -> CuResult {
    cu_entry("cuEventDestroy_v2", || {
        let id = decode(EVENT_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        events()
            .remove(&id)
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

/// The event and the stream must belong to the same context (`CUDA_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub extern "C" fn cuEventRecord(h: *mut c_void, hstream: *mut c_void) -> CuResult {
    cu_entry("cuEventRecord", || {
        let ev = event(h)?;
        let s = resolve_current(hstream)?;
        if ev.ctx != s.ctx {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        ev.latest.record(&s.worker);
        Ok(())
    })
}

/// The event may be of another context (as CUDA allows); never recorded: nothing to wait for.
#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(hstream: *mut c_void, h: *mut c_void, flags: u32) -> CuResult {
    cu_entry("cuStreamWaitEvent", || {
        let s = resolve_current(hstream)?;
        let ev = event(h)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(mark) = ev.latest.get() {
            s.enqueue(Box::new(move || mark.wait().map_err(|c| c as CuResult)));
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(h: *mut c_void) -> CuResult {
    cu_entry("cuEventQuery", || match event(h)?.latest.get() {
        Some(m) if m.time().is_none() => Err(CUDA_ERROR_NOT_READY),
        _ => Ok(()),
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(h: *mut c_void) -> CuResult {
    cu_entry("cuEventSynchronize", || match event(h)?.latest.get() {
        Some(m) => m.wait().map_err(|c| c as CuResult),
        None => Ok(()),
    })
}

/// Both events need timing and a completed record: `CUDA_ERROR_INVALID_HANDLE` for an event
/// without timing or never recorded, `CUDA_ERROR_NOT_READY` for a record still pending.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CuResult {
    cu_entry("cuEventElapsedTime", || {
        let stamp = |h| -> Result<Instant, CuResult> {
            let ev = event(h)?;
            if ev.flags & CU_EVENT_DISABLE_TIMING != 0 {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            ev.latest
                .get()
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?
                .time()
                .ok_or(CUDA_ERROR_NOT_READY)
        };
        let (t0, t1) = (stamp(start)?, stamp(end)?);
        // SAFETY: API contract.
        unsafe { put(ms, elapsed_ms(t0, t1), CUDA_ERROR_INVALID_VALUE) }
    })
}
