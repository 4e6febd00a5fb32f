//! Fault injection: `HP_EMU_FAULTS="name:n:code[,name:n:code...]"` makes the n-th call (1-based,
//! counted per function across the process) of `name` return `code` without doing anything.
//!
//! A spec that cannot be honoured exactly (unknown function name, n = 0, a code that is not an
//! `int`, stray separators) is rejected rather than half-applied: a test that believes it injected
//! a fault which never fires would pass for the wrong reason.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::state::lock;

/// Every entry point a fault can target (the header's functions).
const KNOWN: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtStreamQuery",
    "aclrtCreateEvent",
    "aclrtCreateEventWithFlag",
    "aclrtDestroyEvent",
    "aclrtRecordEvent",
    "aclrtStreamWaitEvent",
    "aclrtSynchronizeEvent",
    "aclrtQueryEventStatus",
    "aclrtEventElapsedTime",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtMemset",
    "aclrtMemsetAsync",
    "aclrtGetMemInfo",
    "aclrtSubscribeReport",
    "aclrtUnSubscribeReport",
    "aclrtLaunchCallback",
    "aclrtProcessReport",
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommDestroy",
    "HcclAllGather",
    "HcclReduceScatter",
    "HcclAllReduce",
    "HcclBroadcast",
    "HcclAlltoAll",
    "HcclAlltoAllV",
    "HcclSend",
    "HcclRecv",
    "HcclGroupStart",
    "HcclGroupEnd",
];

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rule {
    name: &'static str,
    nth: u64,
    code: i32,
}

struct Faults {
    rules: Vec<Rule>,
    calls: HashMap<&'static str, u64>,
    /// `HP_EMU_FAULTS` was set but malformed; `aclInit` reports it until a valid spec replaces it.
    env_malformed: bool,
}

fn faults() -> MutexGuard<'static, Faults> {
    static FAULTS: OnceLock<Mutex<Faults>> = OnceLock::new();
    lock(FAULTS.get_or_init(|| {
        let (rules, env_malformed) = match std::env::var("HP_EMU_FAULTS") {
            Ok(spec) => match parse(&spec) {
                Ok(rules) => (rules, false),
                Err(()) => (Vec::new(), true),
            },
            Err(std::env::VarError::NotPresent) => (Vec::new(), false),
            Err(std::env::VarError::NotUnicode(_)) => (Vec::new(), true),
        };
        Mutex::new(Faults {
            rules,
            calls: HashMap::new(),
            env_malformed,
        })
    }))
}

pub(crate) fn parse(spec: &str) -> Result<Vec<Rule>, ()> {
    if spec.trim().is_empty() {
        return Ok(Vec::new());
    }
    spec.split(',')
        .map(|entry| {
            let mut parts = entry.trim().split(':');
            let (Some(name), Some(nth), Some(code), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(());
            };
            let name = KNOWN
                .iter()
                .copied()
                .find(|k| *k == name.trim())
                .ok_or(())?;
            let nth: u64 = nth.trim().parse().map_err(|_| ())?;
            let code: i32 = code.trim().parse().map_err(|_| ())?;
            if nth == 0 {
                return Err(());
            }
            Ok(Rule { name, nth, code })
        })
        .collect()
}

/// Counts a call of `name`; `Some(code)` when this call is one that must fail.
pub(crate) fn hit(name: &'static str) -> Option<i32> {
    let mut f = faults();
    let n = f.calls.entry(name).or_insert(0);
    *n += 1;
    let n = *n;
    f.rules
        .iter()
        .find(|r| r.name == name && r.nth == n)
        .map(|r| r.code)
}

pub(crate) fn env_malformed() -> bool {
    faults().env_malformed
}

/// Replaces the rules and restarts every call count; a malformed spec changes nothing.
pub(crate) fn replace(spec: &str) -> Result<(), ()> {
    let rules = parse(spec)?;
    let mut f = faults();
    f.rules = rules;
    f.calls.clear();
    f.env_malformed = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(parse("").unwrap(), vec![]);
        let r = parse("aclrtMalloc:2:207001, HcclAllReduce:1:9").unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            Rule {
                name: "aclrtMalloc",
                nth: 2,
                code: 207001
            }
        );
        assert_eq!(
            r[1],
            Rule {
                name: "HcclAllReduce",
                nth: 1,
                code: 9
            }
        );
        for bad in [
            "aclrtMalloc:0:1",
            "aclrtMaloc:1:1",
            "aclrtMalloc:1",
            "aclrtMalloc:1:2:3",
            "aclrtMalloc:x:1",
            "aclrtMalloc:1:99999999999",
            "aclrtMalloc:1:1,",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
