//! Fault injection: `HP_EMU_FAULTS="name:n:code[,name:n:code...]"` makes the n-th call (1-based,
//! counted per function across the process) of `name` return `code` without doing anything.
//!
//! A spec that cannot be honoured exactly (unknown function name, n = 0, a code that is not an
//! `int`, stray separators) is rejected rather than half-applied: a test that believes it injected
//! a fault which never fires would pass for the wrong reason.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::lock;

/// A fault spec that cannot be honoured exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MalformedSpec;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: &'static str,
    pub nth: u64,
    pub code: i32,
}

struct State {
    rules: Vec<Rule>,
    calls: HashMap<&'static str, u64>,
    /// `HP_EMU_FAULTS` was set but malformed; reported until a valid spec replaces it.
    env_malformed: bool,
}

/// The fault rules of one emulator, over the entry points it names in `known`.
pub struct FaultTable {
    known: &'static [&'static str],
    state: OnceLock<Mutex<State>>,
}

impl FaultTable {
    pub const fn new(known: &'static [&'static str]) -> FaultTable {
        FaultTable {
            known,
            state: OnceLock::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(self.state.get_or_init(|| {
            let (rules, env_malformed) = match std::env::var("HP_EMU_FAULTS") {
                Ok(spec) => match self.parse(&spec) {
                    Ok(rules) => (rules, false),
                    Err(MalformedSpec) => (Vec::new(), true),
                },
                Err(std::env::VarError::NotPresent) => (Vec::new(), false),
                Err(std::env::VarError::NotUnicode(_)) => (Vec::new(), true),
            };
            Mutex::new(State {
                rules,
                calls: HashMap::new(),
                env_malformed,
            })
        }))
    }

    pub fn parse(&self, spec: &str) -> Result<Vec<Rule>, MalformedSpec> {
        if spec.trim().is_empty() {
            return Ok(Vec::new());
        }
        spec.split(',')
            .map(|entry| {
                let mut parts = entry.trim().split(':');
                let (Some(name), Some(nth), Some(code), None) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                else {
                    return Err(MalformedSpec);
                };
                let name = self
                    .known
                    .iter()
                    .copied()
                    .find(|k| *k == name.trim())
                    .ok_or(MalformedSpec)?;
                let nth: u64 = nth.trim().parse().map_err(|_| MalformedSpec)?;
                let code: i32 = code.trim().parse().map_err(|_| MalformedSpec)?;
                if nth == 0 {
                    return Err(MalformedSpec);
                }
                Ok(Rule { name, nth, code })
            })
            .collect()
    }

    /// Counts a call of `name`; `Some(code)` when this call is one that must fail.
    pub fn hit(&self, name: &'static str) -> Option<i32> {
        let mut f = self.state();
        let n = f.calls.entry(name).or_insert(0);
        *n += 1;
        let n = *n;
        f.rules
            .iter()
            .find(|r| r.name == name && r.nth == n)
            .map(|r| r.code)
    }

    /// Calls of `name` counted since the process started or the rules were last replaced.
    pub fn calls(&self, name: &str) -> u64 {
        self.state().calls.get(name).copied().unwrap_or(0)
    }

    pub fn env_malformed(&self) -> bool {
        self.state().env_malformed
    }

    /// Replaces the rules and restarts every call count; a malformed spec changes nothing.
    pub fn replace(&self, spec: &str) -> Result<(), MalformedSpec> {
        let rules = self.parse(spec)?;
        let mut f = self.state();
        f.rules = rules;
        f.calls.clear();
        f.env_malformed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static TABLE: FaultTable = FaultTable::new(&["aclrtMalloc", "HcclAllReduce"]);

    #[test]
    fn parses_specs() {
        assert_eq!(TABLE.parse("").unwrap(), vec![]);
        let r = TABLE
            .parse("aclrtMalloc:2:207001, HcclAllReduce:1:9")
            .unwrap();
        assert_eq!(
            r,
            vec![
                Rule {
                    name: "aclrtMalloc",
                    nth: 2,
                    code: 207001
                },
                Rule {
                    name: "HcclAllReduce",
                    nth: 1,
                    code: 9
                }
            ]
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
            assert!(TABLE.parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_nth_call_fails_once() {
        let t = FaultTable::new(&["f"]);
        t.replace("f:2:7").unwrap();
        assert_eq!([t.hit("f"), t.hit("f"), t.hit("f")], [None, Some(7), None]);
        assert_eq!((t.calls("f"), t.calls("g")), (3, 0));
        assert!(t.replace("g:1:1").is_err());
    }
}
