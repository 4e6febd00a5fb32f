//! hprt-hsdp: device mesh, placements, sharded parameters and gradient reduction.
//!
//! Empty until the HSDP issue lands.
