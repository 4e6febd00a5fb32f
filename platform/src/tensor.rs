//! A tensor in device memory: `len` bytes at `offset` in a [`DeviceBuffer`], of a dtype and a
//! shape — the one description swap (`DeviceTensor` holds one), the activation manager (what it
//! saves) and the bindings build on.

use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::handle::{check_range, DeviceBuffer};
use crate::place::Place;

/// A tensor in device memory: `len` bytes at `offset` in `storage`, holding `shape` elements of
/// `dtype` (densely, in row-major order).
///
/// The constructors check what they are given ([`TensorRef::view`]: the extent fits the
/// storage); the fields are public so that the layers above can move a tensor to new storage
/// (swap's reload), and [`TensorRef::check_fits`] checks it again after such a change.
///
/// `hprt_swap::DeviceTensor`'s example shows the constructors in use.
#[derive(Clone, Debug)]
pub struct TensorRef {
    pub storage: DeviceBuffer,
    /// Byte offset of the first element in `storage`.
    pub offset: usize,
    /// Bytes of the tensor: `numel * dtype.size()` for a view; all of `storage` for
    /// [`TensorRef::whole`] (which does not size it from the shape).
    pub len: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorRef {
    /// A tensor spanning all of `storage` (its length as it is now).
    pub fn whole(storage: DeviceBuffer, dtype: DType, shape: Vec<usize>) -> Self {
        let len = storage.len();
        TensorRef {
            storage,
            offset: 0,
            len,
            dtype,
            shape,
        }
    }

    /// A tensor of `shape` starting `offset` bytes into `storage`. Refused with
    /// [`ErrorKind::InvalidValue`] when its byte size overflows, [`ErrorKind::OutOfRange`] when
    /// it does not fit the storage.
    pub fn view(
        storage: DeviceBuffer,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        let len = shape
            .iter()
            .try_fold(dtype.size(), |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidValue,
                    storage.backend(),
                    "tensor view",
                    format!("shape {shape:?} overflows"),
                )
            })?;
        let t = TensorRef {
            storage,
            offset,
            len,
            dtype,
            shape,
        };
        t.check_fits()?;
        Ok(t)
    }

    /// Elements of the tensor (`len / dtype.size()`).
    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// Where the tensor's first element lies, for kernels, collectives and copies.
    pub fn place(&self) -> Place<&DeviceBuffer> {
        self.storage.at(self.offset)
    }

    /// Whether the tensor covers less than its whole storage.
    pub fn is_view(&self) -> bool {
        self.offset != 0 || self.len != self.storage.len()
    }

    /// Whether `offset..offset + len` lies inside the storage (as long as it is now):
    /// [`ErrorKind::OutOfRange`] if not.
    pub fn check_fits(&self) -> Result<()> {
        check_range(
            self.storage.backend(),
            "tensor view",
            "storage",
            self.offset,
            self.len,
            self.storage.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, CpuConfig, Platform};

    #[test]
    fn a_view_is_checked_against_its_storage() {
        let p = CpuBackend::new(CpuConfig::default());
        let storage = p.alloc_device(4096).unwrap();
        let whole = TensorRef::whole(storage.clone(), DType::F32, vec![1024]);
        assert!(!whole.is_view());
        assert_eq!((whole.len, whole.numel()), (4096, 1024));

        let view = TensorRef::view(storage.clone(), 1024, DType::F16, vec![8, 64]).unwrap();
        assert!(view.is_view());
        assert_eq!(
            (view.len, view.numel(), view.place().offset),
            (1024, 512, 1024)
        );

        let past_end = TensorRef::view(storage.clone(), 4000, DType::F32, vec![32]).unwrap_err();
        assert_eq!(past_end.kind, ErrorKind::OutOfRange);
        let wrapping = TensorRef::view(storage.clone(), usize::MAX, DType::F32, vec![1]);
        assert_eq!(wrapping.unwrap_err().kind, ErrorKind::OutOfRange);
        let overflow = TensorRef::view(storage, 0, DType::F32, vec![usize::MAX, 2]).unwrap_err();
        assert_eq!(overflow.kind, ErrorKind::InvalidValue);
    }
}
