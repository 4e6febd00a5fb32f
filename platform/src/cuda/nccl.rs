//! NCCL, loaded at run time: the function table and hprt's dtype / reduce-op mapping.

use std::ffi::{c_char, c_int, c_void, CStr};

use cudarc::nccl::sys::{ncclComm_t, ncclUniqueId};

use super::check::{cuda_err, nccl_error};
use super::dynlib::dyn_table;
use crate::dtype::{DType, ReduceOp};
use crate::error::{ErrorKind, Result};

type Stream = *mut c_void;

/// An NCCL communicator handle; `CommObj` owns it and destroys (or aborts) it once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Comm(ncclComm_t);

// SAFETY: a communicator handle is an identifier NCCL accepts from any thread; hprt issues its
// calls one at a time (the communicator's watch lock).
unsafe impl Send for Comm {}
// SAFETY: `&self` only copies the identifier out; the calls made with it are serialised by the
// communicator's watch lock, as above, and `CommObj` alone destroys it.
unsafe impl Sync for Comm {}

impl Comm {
    pub(crate) fn from_sys(c: ncclComm_t) -> Self {
        Comm(c)
    }
    pub(crate) fn sys(self) -> ncclComm_t {
        self.0
    }
}

dyn_table! {
    /// The NCCL functions hprt uses (all present since NCCL 2.7; `ncclGetLastError` 2.13).
    pub(crate) struct NcclApi {
        required {
            fn ncclGetVersion(version: *mut c_int) -> c_int;
            fn ncclGetUniqueId(id: *mut ncclUniqueId) -> c_int;
            fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> c_int;
            fn ncclCommDestroy(comm: ncclComm_t) -> c_int;
            fn ncclCommAbort(comm: ncclComm_t) -> c_int;
            fn ncclCommGetAsyncError(comm: ncclComm_t, error: *mut c_int) -> c_int;
            fn ncclGetErrorString(result: c_int) -> *const c_char;
            fn ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclReduceScatter(send: *const c_void, recv: *mut c_void, recv_count: usize, dtype: c_int, op: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclAllGather(send: *const c_void, recv: *mut c_void, send_count: usize, dtype: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, root: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclSend(send: *const c_void, count: usize, dtype: c_int, peer: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclRecv(recv: *mut c_void, count: usize, dtype: c_int, peer: c_int, comm: ncclComm_t, stream: Stream) -> c_int;
            fn ncclGroupStart() -> c_int;
            fn ncclGroupEnd() -> c_int;
        }
        optional {
            fn ncclGetLastError(comm: ncclComm_t) -> *const c_char;
        }
    }
}

/// NCCL's `ncclUniqueId` size.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// NCCL 2.10 added `ncclAvg` and `ncclBfloat16`.
pub(crate) const AVG_AND_BF16_SINCE: i32 = 21000;

pub(crate) struct Nccl {
    pub api: NcclApi,
    /// `NCCL_VERSION_CODE` of the loaded library (major * 10000 + minor * 100 + patch).
    pub version: i32,
    pub path: String,
}

impl Nccl {
    /// `Ok` for `ncclSuccess`, else a typed error with NCCL's last-error text where it has one.
    pub(crate) fn check(&self, code: c_int, function: &'static str) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        let text = |p: *const c_char| {
            // SAFETY: NCCL returns NUL-terminated strings it owns (or null).
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // The thread's last error says what went wrong; the generic string is the fallback.
        let detail = self
            .api
            .ncclGetLastError
            // SAFETY: a null communicator asks for the last error of the calling thread.
            .and_then(|f| text(unsafe { f(std::ptr::null_mut()) }))
            .filter(|t| !t.is_empty())
            // SAFETY: plain NCCL call.
            .or_else(|| text(unsafe { (self.api.ncclGetErrorString)(code) }))
            .unwrap_or_default();
        Err(nccl_error(code, function, &detail))
    }

    pub(crate) fn has_avg_and_bf16(&self) -> bool {
        self.version >= AVG_AND_BF16_SINCE
    }

    /// The version as NCCL prints it (`2.21.5`).
    pub(crate) fn version_string(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
        } else {
            // Before 2.9 the code was major * 1000 + minor * 100 + patch.
            format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
        }
    }
}

/// `ncclDataType_t` of a dtype.
pub(crate) fn nccl_dtype(d: DType) -> c_int {
    match d {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// `ncclRedOp_t` of a reduce op.
pub(crate) fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// Refuses what an NCCL older than 2.10 cannot do.
pub(crate) fn check_supported(
    nccl: &Nccl,
    dtype: DType,
    op: Option<ReduceOp>,
    name: &'static str,
) -> Result<()> {
    if dtype == DType::BF16 && !nccl.has_avg_and_bf16() {
        return Err(cuda_err(
            ErrorKind::Unsupported,
            name,
            format!(
                "bf16 needs NCCL 2.10 or newer; {} is {}",
                nccl.path,
                nccl.version_string()
            ),
        ));
    }
    if op == Some(ReduceOp::Avg) && !nccl.has_avg_and_bf16() && !dtype.is_float() {
        return Err(cuda_err(
            ErrorKind::Unsupported,
            name,
            format!(
                "an integer avg needs ncclAvg (NCCL 2.10 or newer); {} is {}",
                nccl.path,
                nccl.version_string()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_codes_are_nccls() {
        use cudarc::nccl::sys::{ncclDataType_t as T, ncclRedOp_t as O};
        for (d, t) in [
            (DType::I8, T::ncclInt8),
            (DType::U8, T::ncclUint8),
            (DType::I32, T::ncclInt32),
            (DType::I64, T::ncclInt64),
            (DType::F16, T::ncclFloat16),
            (DType::F32, T::ncclFloat32),
            (DType::F64, T::ncclFloat64),
            (DType::BF16, T::ncclBfloat16),
        ] {
            assert_eq!(nccl_dtype(d), t as c_int, "{d}");
        }
        for (op, o) in [
            (ReduceOp::Sum, O::ncclSum),
            (ReduceOp::Prod, O::ncclProd),
            (ReduceOp::Max, O::ncclMax),
            (ReduceOp::Min, O::ncclMin),
            (ReduceOp::Avg, O::ncclAvg),
        ] {
            assert_eq!(nccl_op(op), o as c_int, "{op}");
        }
        assert_eq!(std::mem::size_of::<ncclUniqueId>(), UNIQUE_ID_BYTES);
    }
}
