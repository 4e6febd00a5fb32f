//! What a collective does, described once for every backend.

use crate::dtype::{DType, ReduceOp};
use crate::error::{BackendKind, Error, ErrorKind, Result};

/// One collective operation over a communicator of `world` ranks. `R` names a place in device
/// memory: a `Place<&DeviceBuffer>` ([`crate::Place`]) above the backend layer, the backend's own memory object below it.
///
/// Counts are in elements of `dtype`; the places each rank's buffers must hold, with their byte
/// sizes, are given by [`Collective::places`].
#[derive(Clone, Debug)]
pub enum Collective<R> {
    /// `recv = op(send of every rank)`, `count` elements; `send` and `recv` may be the same place.
    AllReduce {
        send: R,
        recv: R,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    /// Rank r's `count` elements land at `recv[r * count..]` on every rank (one output buffer).
    AllGather {
        send: R,
        recv: R,
        count: usize,
        dtype: DType,
    },
    /// `send` holds `world * count` elements; rank r receives `op` over every rank's block r.
    ReduceScatter {
        send: R,
        recv: R,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    /// In place: `root`'s `count` elements replace `buf` on every rank.
    Broadcast {
        buf: R,
        count: usize,
        dtype: DType,
        root: usize,
    },
    /// Block q of rank r's `send` (`count` elements) lands in block r of rank q's `recv`.
    AllToAll {
        send: R,
        recv: R,
        count: usize,
        dtype: DType,
    },
    /// All-to-all with per-peer counts and element displacements.
    AllToAllV {
        send: R,
        recv: R,
        send_counts: Vec<usize>,
        send_displs: Vec<usize>,
        recv_counts: Vec<usize>,
        recv_displs: Vec<usize>,
        dtype: DType,
    },
    /// Point-to-point send of `count` elements to `peer`, matched in order with its `Recv`.
    Send {
        send: R,
        count: usize,
        dtype: DType,
        peer: usize,
    },
    Recv {
        recv: R,
        count: usize,
        dtype: DType,
        peer: usize,
    },
    /// Completes on every rank once every rank reached it.
    Barrier,
}

impl<R> Collective<R> {
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "all_reduce",
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::Broadcast { .. } => "broadcast",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::AllToAllV { .. } => "all_to_all_v",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
            Collective::Barrier => "barrier",
        }
    }

    pub fn dtype(&self) -> Option<DType> {
        match self {
            Collective::AllReduce { dtype, .. }
            | Collective::AllGather { dtype, .. }
            | Collective::ReduceScatter { dtype, .. }
            | Collective::Broadcast { dtype, .. }
            | Collective::AllToAll { dtype, .. }
            | Collective::AllToAllV { dtype, .. }
            | Collective::Send { dtype, .. }
            | Collective::Recv { dtype, .. } => Some(*dtype),
            Collective::Barrier => None,
        }
    }

    /// The memory places, each with the byte extent the operation reads or writes there.
    pub fn places(&self, world: usize) -> Vec<(&R, usize)> {
        let sz = self.dtype().map_or(0, DType::size);
        // Saturating: an absurd count becomes a size no buffer holds, so the bounds check refuses
        // it instead of a wrapped product passing it.
        let span = |blocks: usize, count: usize| blocks.saturating_mul(count).saturating_mul(sz);
        match self {
            Collective::AllReduce {
                send, recv, count, ..
            } => {
                vec![(send, span(1, *count)), (recv, span(1, *count))]
            }
            Collective::AllGather {
                send, recv, count, ..
            } => {
                vec![(send, span(1, *count)), (recv, span(world, *count))]
            }
            Collective::ReduceScatter {
                send, recv, count, ..
            } => {
                vec![(send, span(world, *count)), (recv, span(1, *count))]
            }
            Collective::Broadcast { buf, count, .. } => vec![(buf, span(1, *count))],
            Collective::AllToAll {
                send, recv, count, ..
            } => {
                vec![(send, span(world, *count)), (recv, span(world, *count))]
            }
            Collective::AllToAllV {
                send,
                recv,
                send_counts,
                send_displs,
                recv_counts,
                recv_displs,
                ..
            } => vec![
                (send, span(1, extent(send_counts, send_displs))),
                (recv, span(1, extent(recv_counts, recv_displs))),
            ],
            Collective::Send { send, count, .. } => vec![(send, span(1, *count))],
            Collective::Recv { recv, count, .. } => vec![(recv, span(1, *count))],
            Collective::Barrier => vec![],
        }
    }

    /// Checks what one rank can check alone: peers, roots and count vectors against the world size.
    pub fn validate(&self, backend: BackendKind, world: usize) -> Result<()> {
        let bad = |msg: String| {
            Err(Error::new(
                ErrorKind::InvalidValue,
                backend,
                self.name(),
                msg,
            ))
        };
        match self {
            Collective::Broadcast { root, .. } if *root >= world => {
                bad(format!("root {root} is not a rank of a world of {world}"))
            }
            Collective::Send { peer, .. } | Collective::Recv { peer, .. } if *peer >= world => {
                bad(format!("peer {peer} is not a rank of a world of {world}"))
            }
            Collective::AllToAllV {
                send_counts,
                send_displs,
                recv_counts,
                recv_displs,
                ..
            } => {
                for (name, v) in [
                    ("send_counts", send_counts),
                    ("send_displs", send_displs),
                    ("recv_counts", recv_counts),
                    ("recv_displs", recv_displs),
                ] {
                    if v.len() != world {
                        return bad(format!(
                            "{name} has {} entries for a world of {world}",
                            v.len()
                        ));
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The same operation over other memory places.
    pub fn try_map<S>(self, mut f: impl FnMut(R) -> Result<S>) -> Result<Collective<S>> {
        Ok(match self {
            Collective::AllReduce {
                send,
                recv,
                count,
                dtype,
                op,
            } => Collective::AllReduce {
                send: f(send)?,
                recv: f(recv)?,
                count,
                dtype,
                op,
            },
            Collective::AllGather {
                send,
                recv,
                count,
                dtype,
            } => Collective::AllGather {
                send: f(send)?,
                recv: f(recv)?,
                count,
                dtype,
            },
            Collective::ReduceScatter {
                send,
                recv,
                count,
                dtype,
                op,
            } => Collective::ReduceScatter {
                send: f(send)?,
                recv: f(recv)?,
                count,
                dtype,
                op,
            },
            Collective::Broadcast {
                buf,
                count,
                dtype,
                root,
            } => Collective::Broadcast {
                buf: f(buf)?,
                count,
                dtype,
                root,
            },
            Collective::AllToAll {
                send,
                recv,
                count,
                dtype,
            } => Collective::AllToAll {
                send: f(send)?,
                recv: f(recv)?,
                count,
                dtype,
            },
            Collective::AllToAllV {
                send,
                recv,
                send_counts,
                send_displs,
                recv_counts,
                recv_displs,
                dtype,
            } => Collective::AllToAllV {
                send: f(send)?,
                recv: f(recv)?,
                send_counts,
                send_displs,
                recv_counts,
                recv_displs,
                dtype,
            },
            Collective::Send {
                send,
                count,
                dtype,
                peer,
            } => Collective::Send {
                send: f(send)?,
                count,
                dtype,
                peer,
            },
            Collective::Recv {
                recv,
                count,
                dtype,
                peer,
            } => Collective::Recv {
                recv: f(recv)?,
                count,
                dtype,
                peer,
            },
            Collective::Barrier => Collective::Barrier,
        })
    }
}

/// Elements spanned by blocks at `displs` of `counts` elements (0 when every block is empty).
fn extent(counts: &[usize], displs: &[usize]) -> usize {
    counts
        .iter()
        .zip(displs)
        .filter(|(c, _)| **c > 0)
        .map(|(c, d)| c.saturating_add(*d))
        .max()
        .unwrap_or(0)
}

/// How long a collective may stay unfinished before its backend gives up on it, unless
/// `HP_COLLECTIVE_TIMEOUT_MS` (every backend that times collectives out) or a backend's own
/// variable says otherwise.
pub const DEFAULT_COLLECTIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// The collective timeout the environment sets: `specific` (a backend's own variable, such as
/// `HP_CPU_COLLECTIVE_TIMEOUT_MS`) if set, else `HP_COLLECTIVE_TIMEOUT_MS`; `None` when neither
/// is. A value that is not a whole number of milliseconds is an error naming the variable.
pub(crate) fn collective_timeout_from_env(
    backend: BackendKind,
    specific: Option<&str>,
) -> Result<Option<std::time::Duration>> {
    collective_timeout_from(backend, specific, |name| std::env::var(name).ok())
}

fn collective_timeout_from(
    backend: BackendKind,
    specific: Option<&str>,
    var: impl Fn(&str) -> Option<String>,
) -> Result<Option<std::time::Duration>> {
    for name in specific.into_iter().chain(["HP_COLLECTIVE_TIMEOUT_MS"]) {
        let Some(v) = var(name).filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        return match v.trim().parse() {
            Ok(ms) => Ok(Some(std::time::Duration::from_millis(ms))),
            Err(_) => Err(Error::new(
                ErrorKind::InvalidValue,
                backend,
                "configure",
                format!("{name}={v:?} is not milliseconds"),
            )),
        };
    }
    Ok(None)
}

#[cfg(test)]
mod timeout_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_backends_own_variable_overrides_the_shared_one() {
        let read = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let cpu = Some("HP_CPU_COLLECTIVE_TIMEOUT_MS");
        let both = read(&[
            ("HP_COLLECTIVE_TIMEOUT_MS", "1000"),
            ("HP_CPU_COLLECTIVE_TIMEOUT_MS", "250"),
        ]);
        let t = |specific, var| collective_timeout_from(BackendKind::Cpu, specific, var);
        assert_eq!(t(cpu, both).unwrap(), Some(Duration::from_millis(250)));
        assert_eq!(t(None, both).unwrap(), Some(Duration::from_millis(1000)));
        let shared = read(&[("HP_COLLECTIVE_TIMEOUT_MS", " 1500 ")]);
        assert_eq!(t(cpu, shared).unwrap(), Some(Duration::from_millis(1500)));
        assert_eq!(t(cpu, read(&[])).unwrap(), None);
        let bad = t(None, read(&[("HP_COLLECTIVE_TIMEOUT_MS", "1s")])).unwrap_err();
        assert_eq!(bad.kind, ErrorKind::InvalidValue);
        assert!(bad.message.contains("HP_COLLECTIVE_TIMEOUT_MS"), "{bad}");
    }
}
