//! hprt-compress: lossless activation compression (codec, cost model, planner, layer manager).
//!
//! Empty until the compression issue lands.
