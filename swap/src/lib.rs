//! hprt-swap: activation swap between device and pinned host memory, written once against
//! `hprt_platform::Platform`.
//!
//! Empty until the swap issue lands (state machine, pinned pool, layer-group, keyed and chunked
//! pipeline front ends).
