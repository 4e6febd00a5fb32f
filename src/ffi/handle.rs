//! C handles as validated ids: every object the C ABI hands out lives in a [`Registry`] of its
//! kind, and the `HprtPlatform *`, `HprtStream *`, ... a C caller holds is an id — kind tag,
//! slot generation and slot index packed into the pointer's bits — never an address. C code
//! treats the types as opaque, so nothing changes for it, but a freed, closed, destroyed, twice
//! released, never issued or wrong-kind handle is looked up and found missing:
//! `HPRT_STATUS_ERROR_INVALID_HANDLE`, not undefined behaviour.
//!
//! One mechanism for every kind: [`arg`] resolves a handle for the call, [`publish`] registers a
//! new object after checking the out-pointer (so a null out-pointer makes nothing and leaks
//! nothing), [`release`] removes one. A resolved object is kept alive until the entry point
//! returns (its `Arc` is held in a per-thread list that [`super::guard`] clears), so a release
//! on another thread cannot free it mid-call. Kinds used through `&mut` (swap managers, hsdp
//! contexts and parameters) are stored as [`Exclusive`]: one call at a time, a second
//! concurrent one is `HPRT_STATUS_ERROR_WRONG_STATE`. A destroy is such a call: racing a use,
//! it is refused the same way and the handle stays valid (the caller destroys it again once
//! the use returned; it is never released under the use).
//!
//! Adopting it for a new handle type: `handle_kind!(HprtThing, KIND, "thing")` (shared) or
//! `handle_kind!(exclusive HprtThing, KIND, "thing")`, with a kind number not used yet.

use std::any::Any;
use std::cell::{RefCell, UnsafeCell};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::{FfiError, FfiResult, HprtStatus};

/// A handle kind: its tag in ids, its name in messages, what its registry stores.
pub(crate) trait Handle: 'static {
    /// The object kept in the registry: the handle type itself, or [`Exclusive`] of it.
    type Stored: Send + Sync + 'static;
    const NAME: &'static str;
    fn registry() -> &'static Registry<Self::Stored>;
}

/// Declares a handle kind and its registry. `$kind` (1..=255) is the tag in the kind's ids:
/// distinct per kind, so a handle of one kind is never valid as another.
macro_rules! handle_kind {
    (exclusive $t:ty, $kind:expr, $name:expr) => {
        $crate::ffi::handle::handle_kind!(@impl $t, $crate::ffi::handle::Exclusive<$t>, $kind, $name);
    };
    ($t:ty, $kind:expr, $name:expr) => {
        $crate::ffi::handle::handle_kind!(@impl $t, $t, $kind, $name);
    };
    (@impl $t:ty, $stored:ty, $kind:expr, $name:expr) => {
        impl $crate::ffi::handle::Handle for $t {
            type Stored = $stored;
            const NAME: &'static str = $name;
            fn registry() -> &'static $crate::ffi::handle::Registry<$stored> {
                static REGISTRY: $crate::ffi::handle::Registry<$stored> =
                    $crate::ffi::handle::Registry::new($kind);
                &REGISTRY
            }
        }
    };
}
pub(crate) use handle_kind;

const INDEX_BITS: u32 = 32;
const GEN_BITS: u32 = 24;
const GEN_LIMIT: u32 = 1 << GEN_BITS;
// Ids are pointer-sized in C: the packing needs 64-bit pointers (every supported target).
const _: () = assert!(usize::BITS == 64);

struct Slot<T> {
    /// Bumped when the slot's object is released; starts at 1, so no id is ever 0 (NULL).
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

/// The live objects of one kind, by id. Ids are never reissued: a slot is reused with the next
/// generation, and retired once its generation would wrap.
pub(crate) struct Registry<T> {
    kind: u8,
    inner: Mutex<Slots<T>>,
}

impl<T: Send + Sync + 'static> Registry<T> {
    pub(crate) const fn new(kind: u8) -> Self {
        Registry {
            kind,
            inner: Mutex::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots<T>> {
        hprt_platform::sync::lock(&self.inner)
    }

    fn id(&self, index: u32, generation: u32) -> usize {
        (self.kind as usize) << (INDEX_BITS + GEN_BITS)
            | (generation as usize) << INDEX_BITS
            | index as usize
    }

    /// (index, generation) of `id` if it carries this registry's kind tag.
    fn split(&self, id: usize) -> Option<(usize, u32)> {
        let kind = (id >> (INDEX_BITS + GEN_BITS)) as u8;
        let generation = ((id >> INDEX_BITS) as u32) & (GEN_LIMIT - 1);
        (id >> (INDEX_BITS + GEN_BITS) < 256 && kind == self.kind)
            .then_some(((id & u32::MAX as usize), generation))
    }

    pub(crate) fn insert(&self, value: T) -> usize {
        let mut s = self.lock();
        let value = Some(Arc::new(value));
        if let Some(index) = s.free.pop() {
            let slot = &mut s.slots[index as usize];
            slot.value = value;
            return self.id(index, slot.generation);
        }
        let index = u32::try_from(s.slots.len()).expect("fewer than 2^32 live handles");
        s.slots.push(Slot {
            generation: 1,
            value,
        });
        self.id(index, 1)
    }

    pub(crate) fn get(&self, id: usize) -> Option<Arc<T>> {
        let (index, generation) = self.split(id)?;
        let s = self.lock();
        let slot = s.slots.get(index)?;
        (slot.generation == generation).then(|| slot.value.clone())?
    }

    pub(crate) fn remove(&self, id: usize) -> Option<Arc<T>> {
        let (index, generation) = self.split(id)?;
        let mut s = self.lock();
        let slot = s
            .slots
            .get_mut(index)
            .filter(|s| s.generation == generation)?;
        let value = slot.value.take()?;
        slot.generation += 1;
        if slot.generation < GEN_LIMIT {
            s.free.push(index as u32);
        }
        Some(value)
    }
}

/// An object one call may use at a time (through `&mut`).
pub(crate) struct Exclusive<T> {
    busy: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through `claim`, which hands out one `&mut` at a time (as
// a mutex would), so sharing the wrapper across threads needs only `T: Send`.
unsafe impl<T: Send> Sync for Exclusive<T> {}

impl<T> Exclusive<T> {
    pub(crate) fn new(value: T) -> Self {
        Exclusive {
            busy: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }
}

/// Releases an [`Exclusive`] claim when the entry point returns.
struct Claim<T: Send + 'static>(Arc<Exclusive<T>>);

impl<T: Send + 'static> Drop for Claim<T> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

thread_local! {
    /// What the running entry points of this thread resolved: kept alive (and claimed) until
    /// the entry point returns.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// Marks the start of an entry point; pass the mark to [`end_call`] when it returns.
pub(crate) fn begin_call() -> usize {
    HELD.with(|h| h.borrow().len())
}

/// Drops what the entry point that started at `mark` resolved (releasing its claims).
pub(crate) fn end_call(mark: usize) {
    let held = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let at = mark.min(h.len());
        h.split_off(at)
    });
    // Dropped outside the borrow: a last reference may run a destructor.
    drop(held);
}

fn hold<T: 'static>(value: T) {
    HELD.with(|h| h.borrow_mut().push(Box::new(value)));
}

fn invalid_handle(what: &str, name: &str) -> FfiError {
    FfiError {
        status: HprtStatus::ErrorInvalidHandle,
        message: format!(
            "{what} is not a live {name} handle (released, closed, never issued, or another kind)"
        ),
    }
}

fn lookup<H: Handle>(p: *const H, what: &str) -> FfiResult<Arc<H::Stored>> {
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    H::registry()
        .get(p as usize)
        .ok_or_else(|| invalid_handle(what, H::NAME))
}

/// Resolves a handle argument for the rest of the entry point.
pub(crate) fn arg<'a, H: Handle>(p: *const H, what: &str) -> FfiResult<&'a H::Stored> {
    let obj = lookup(p, what)?;
    let r: *const H::Stored = Arc::as_ptr(&obj);
    hold(obj);
    // SAFETY: the `Arc` just held stays alive until the entry point returns (`end_call`), and
    // the reference is not kept past the call.
    Ok(unsafe { &*r })
}

/// Resolves a handle that may be null (`None`).
pub(crate) fn opt_arg<'a, H: Handle>(p: *const H, what: &str) -> FfiResult<Option<&'a H::Stored>> {
    if p.is_null() {
        return Ok(None);
    }
    arg(p, what).map(Some)
}

/// Resolves a handle of an exclusive kind for mutation; a second concurrent use is refused.
pub(crate) fn arg_mut<'a, H>(p: *const H, what: &str) -> FfiResult<&'a mut H>
where
    H: Handle<Stored = Exclusive<H>> + Send,
{
    let obj = lookup(p, what)?;
    if obj.busy.swap(true, Ordering::Acquire) {
        return Err(FfiError {
            status: HprtStatus::ErrorWrongState,
            message: format!("{what}: this {} is in use by another call", H::NAME),
        });
    }
    let r: *mut H = obj.value.get();
    hold(Claim(obj));
    // SAFETY: the claim is exclusive (the flag was clear) and held, with the object, until the
    // entry point returns.
    Ok(unsafe { &mut *r })
}

/// Registers the object `make` returns and writes its handle to `out`, checking `out` first so
/// a null out-pointer makes (and leaks) nothing.
///
/// # Safety
/// `out` null or valid for writing a pointer.
pub(crate) unsafe fn publish<H: Handle>(
    out: *mut *mut H,
    what: &str,
    make: impl FnOnce() -> FfiResult<H::Stored>,
) -> FfiResult {
    if out.is_null() {
        return Err(FfiError::null(what));
    }
    let id = H::registry().insert(make()?);
    // SAFETY: non-null, valid by the caller's contract.
    unsafe { out.write(id as *mut H) };
    Ok(())
}

/// Removes a handle: it is invalid from now on; the object is dropped once the entry points
/// using it (this one included) return. Destroy calls release after the backend accepted the
/// destruction, so a refused one (another platform's buffer) leaves the handle valid.
pub(crate) fn release<H: Handle>(p: *const H, what: &str) -> FfiResult {
    lookup(p, what)?;
    H::registry()
        .remove(p as usize)
        .map(drop)
        .ok_or_else(|| invalid_handle(what, H::NAME))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_kind_and_generation_and_are_never_reissued() {
        let a: Registry<u32> = Registry::new(7);
        let b: Registry<u32> = Registry::new(8);
        let x = a.insert(1);
        assert_ne!(x, 0);
        assert_eq!(a.get(x).as_deref(), Some(&1));
        assert!(b.get(x).is_none(), "another kind's id");
        assert!(a.remove(x).is_some());
        assert!(a.get(x).is_none() && a.remove(x).is_none(), "stale id");
        let y = a.insert(2);
        assert_ne!(x, y, "the slot comes back with a new generation");
        assert_eq!(a.get(y).as_deref(), Some(&2));
        assert!(a.get(y ^ 1 << 40).is_none() && a.get(usize::MAX).is_none());
    }
}
