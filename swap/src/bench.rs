use crate::error::Result; use hprt_platform::Platform; /// placeholder until written
pub fn bench(_p: &dyn Platform, _max: usize) -> Result<String> { Err(crate::SwapError::Order("bench not written".into())) }
