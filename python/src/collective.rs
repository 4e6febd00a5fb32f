//! `hprt.Communicator`: collectives over device buffers. Ranks are threads (or processes) that
//! each call `Platform.comm_init`; every collective releases the GIL while it is issued so the
//! other rank threads of the process can reach it too.

use hprt_platform::{DType, ReduceOp};
use pyo3::prelude::*;

use crate::error::Result;
use crate::handles::{PyCommunicator, PyDeviceBuffer, PyStream};

fn op(name: &str) -> Result<ReduceOp> {
    Ok(name.parse()?)
}

#[pymethods]
impl PyCommunicator {
    #[getter]
    fn rank(&self) -> usize {
        self.c.rank()
    }
    #[getter]
    fn world(&self) -> usize {
        self.c.world()
    }

    /// `recv = reduce_op(send of every rank)`, `count` elements (`send` may be `recv`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (send, recv, count, dtype, op_name, stream, send_offset=0, recv_offset=0))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: &PyDeviceBuffer,
        recv: &PyDeviceBuffer,
        count: usize,
        dtype: &str,
        op_name: &str,
        stream: &PyStream,
        send_offset: usize,
        recv_offset: usize,
    ) -> Result<()> {
        let (dt, o) = (dtype.parse::<DType>()?, op(op_name)?);
        py.detach(|| {
            Ok(self.p.all_reduce(
                send.b.at(send_offset),
                recv.b.at(recv_offset),
                count,
                dt,
                o,
                &self.c,
                &stream.s,
            )?)
        })
    }

    /// Every rank's `count` elements land in `recv` in rank order.
    fn all_gather(
        &self,
        py: Python<'_>,
        send: &PyDeviceBuffer,
        recv: &PyDeviceBuffer,
        count: usize,
        dtype: &str,
        stream: &PyStream,
    ) -> Result<()> {
        let dt = dtype.parse::<DType>()?;
        py.detach(|| {
            Ok(self.p.all_gather(
                (&send.b).into(),
                (&recv.b).into(),
                count,
                dt,
                &self.c,
                &stream.s,
            )?)
        })
    }

    /// `send` holds `world * count` elements; this rank receives the reduction of block `rank`.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &PyDeviceBuffer,
        recv: &PyDeviceBuffer,
        count: usize,
        dtype: &str,
        op_name: &str,
        stream: &PyStream,
    ) -> Result<()> {
        let (dt, o) = (dtype.parse::<DType>()?, op(op_name)?);
        py.detach(|| {
            Ok(self.p.reduce_scatter(
                (&send.b).into(),
                (&recv.b).into(),
                count,
                dt,
                o,
                &self.c,
                &stream.s,
            )?)
        })
    }

    fn broadcast(
        &self,
        py: Python<'_>,
        buf: &PyDeviceBuffer,
        count: usize,
        dtype: &str,
        root: usize,
        stream: &PyStream,
    ) -> Result<()> {
        let dt = dtype.parse::<DType>()?;
        py.detach(|| {
            Ok(self
                .p
                .broadcast((&buf.b).into(), count, dt, root, &self.c, &stream.s)?)
        })
    }

    fn barrier(&self, py: Python<'_>, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(self.p.barrier(&self.c, &stream.s)?))
    }

    /// The communicator of the rank list holding this rank (`None` if no list does); every
    /// rank calls it with the same lists.
    fn split(&self, py: Python<'_>, rank_lists: Vec<Vec<usize>>) -> Result<Option<PyCommunicator>> {
        let comm = self.c.clone();
        let c =
            crate::wait::interruptible(py, &self.p, move |p| p.comm_split(&comm, &rank_lists))??;
        Ok(c.map(|c| PyCommunicator {
            p: self.p.clone(),
            c,
        }))
    }

    fn destroy(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(self.p.destroy_comm(&self.c)?))
    }

    /// What a rank that failed does: ends this communicator now, without waiting for its
    /// queued collectives, so that peers waiting for this rank fail at once (cpu; cuda:
    /// `ncclCommAbort`). HCCL has no abort: on npu this is `destroy` and peers fail at HCCL's
    /// timeout.
    fn abort(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(self.p.abort_comm(&self.c)?))
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.c)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCommunicator>()
}
