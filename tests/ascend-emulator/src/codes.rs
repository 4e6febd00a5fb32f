//! Status codes, enum values and C-side types of `sys/include/hprt_ascend.h`.
//!
//! C enums whose values are all non-negative are `unsigned int` under the SysV ABI (and bindgen
//! maps them to `c_uint`), so enum parameters and `HcclResult` are `u32`; `aclError` is `int`.

/// `aclError`.
pub type AclError = i32;
/// `HcclResult`.
pub type HcclResult = u32;

pub const ACL_SUCCESS: AclError = 0;
pub const ACL_ERROR_INVALID_PARAM: AclError = 100000;
pub const ACL_ERROR_UNINITIALIZE: AclError = 100001;
pub const ACL_ERROR_REPEAT_INITIALIZE: AclError = 100002;
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: AclError = 207001;
pub const ACL_ERROR_RT_INTERNAL_ERROR: AclError = 507000;
pub const ACL_ERROR_RT_REPORT_TIMEOUT: AclError = 507012;

pub const ACL_EVENT_SYNC: u32 = 0x1;
pub const ACL_EVENT_TIME_LINE: u32 = 0x8;

pub const ACL_MEMCPY_HOST_TO_HOST: u32 = 0;
pub const ACL_MEMCPY_HOST_TO_DEVICE: u32 = 1;
pub const ACL_MEMCPY_DEVICE_TO_HOST: u32 = 2;
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: u32 = 3;
pub const ACL_MEMCPY_DEFAULT: u32 = 4;

/// `aclrtMemMallocPolicy` values are 0 (`HUGE_FIRST`), 1 (`HUGE_ONLY`), 2 (`NORMAL_ONLY`).
pub const ACL_MEM_MALLOC_MAX_POLICY: u32 = 2;

pub const ACL_DDR_MEM: u32 = 0;
pub const ACL_HBM_MEM: u32 = 1;

pub const ACL_EVENT_RECORDED_STATUS_NOT_READY: u32 = 0;
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: u32 = 1;

pub const ACL_STREAM_STATUS_COMPLETE: u32 = 0;
pub const ACL_STREAM_STATUS_NOT_READY: u32 = 1;

pub const ACL_CALLBACK_NO_BLOCK: u32 = 0;
pub const ACL_CALLBACK_BLOCK: u32 = 1;

pub const HCCL_SUCCESS: HcclResult = 0;
pub const HCCL_E_PARA: HcclResult = 1;
pub const HCCL_E_PTR: HcclResult = 2;
pub const HCCL_E_INTERNAL: HcclResult = 4;
pub const HCCL_E_NOT_SUPPORT: HcclResult = 5;
pub const HCCL_E_TIMEOUT: HcclResult = 9;
pub const HCCL_E_RUNTIME: HcclResult = 15;

pub const HCCL_REDUCE_SUM: u32 = 0;
pub const HCCL_REDUCE_PROD: u32 = 1;
pub const HCCL_REDUCE_MAX: u32 = 2;
pub const HCCL_REDUCE_MIN: u32 = 3;

pub const HCCL_DATA_TYPE_INT128: u32 = 12;

pub const HCCL_ROOT_INFO_BYTES: usize = 4108;

/// `aclrtCallback`.
pub type AclrtCallback = Option<unsafe extern "C" fn(user_data: *mut core::ffi::c_void)>;
