//! hprt-sys: raw FFI for the Ascend ACL runtime and HCCL.
//!
//! Empty until the Ascend backend issue lands: the in-tree C header, the bindgen output and the
//! libloading function tables arrive with it. Nothing here pretends to work before then.
