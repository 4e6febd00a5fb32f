//! Sharded parameters through the C ABI, one thread per rank on an opened cpu platform: the
//! shard each rank keeps, the full parameter after unshard, and the reduce-scattered (and, for
//! HSDP, all-reduced) gradients, each compared with a host reference; lifecycle and argument
//! errors as typed statuses.

use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;
mod c_abi_common;
use c_abi_common::*;

#[path = "c_abi_hsdp/errors.rs"]
mod errors;
#[path = "c_abi_hsdp/lifecycle.rs"]
mod lifecycle;
#[path = "c_abi_hsdp/meshes.rs"]
mod meshes;

/// One rank thread's handles.
struct Rank {
    p: *const HprtPlatform,
    s: *mut HprtStream,
    comm: *mut HprtComm,
    rank: usize,
    world: usize,
}

impl Rank {
    /// How a parameter test ends: the compute stream's work finished, `bufs` freed, then the
    /// parameter and its context destroyed.
    ///
    /// # Safety
    /// Every handle is live and not used again.
    unsafe fn finish(
        &self,
        bufs: &[*mut HprtDeviceBuffer],
        w: *mut HprtHsdpParam,
        h: *mut HprtHsdp,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            ok(hprt_stream_synchronize(self.p, self.s));
            for &b in bufs {
                ok(hprt_device_free(self.p, b));
            }
            ok(hprt_hsdp_param_destroy(w));
            ok(hprt_hsdp_destroy(h));
        }
    }

    /// A device buffer holding `bytes`, written in compute-stream order.
    fn upload(&self, bytes: &[u8]) -> *mut HprtDeviceBuffer {
        // SAFETY: this rank's handles are live.
        unsafe { upload(self.p, self.s, bytes) }
    }

    /// Reads `bytes` at a device address (what the hsdp calls return) after the compute
    /// stream's queued work, the way a framework would: wrapped, then copied to pinned memory.
    fn download(&self, address: usize, bytes: usize) -> Vec<u8> {
        // SAFETY: `address..+bytes` is live device memory of this platform during the call.
        unsafe {
            let (mut dev, mut host) = (ptr::null_mut(), ptr::null_mut());
            ok(hprt_device_wrap(
                self.p,
                address,
                bytes,
                None,
                ptr::null_mut(),
                &mut dev,
            ));
            ok(hprt_pinned_alloc(self.p, bytes, &mut host));
            ok(hprt_copy_async(
                self.p,
                pinned_ref(host),
                device_ref(dev, 0),
                bytes,
                self.s,
            ));
            ok(hprt_stream_synchronize(self.p, self.s));
            let out = pinned_slice::<u8>(host, bytes).to_vec();
            ok(hprt_pinned_free(self.p, host));
            ok(hprt_device_free(self.p, dev));
            out
        }
    }

    fn view(&self, v: HprtShardView) -> Vec<f32> {
        assert!(!v.host, "no offload was asked for");
        f32s(&self.download(v.address, v.bytes))
    }

    fn hsdp(&self, mode: HprtDpMode, shape: &[usize]) -> *mut HprtHsdp {
        let mut h = ptr::null_mut();
        // SAFETY: live handles, `shape` readable for its length.
        ok(unsafe {
            hprt_hsdp_create(
                self.p,
                self.comm,
                mode as i32,
                shape.as_ptr(),
                shape.len(),
                self.s,
                &mut h,
            )
        });
        h
    }
}

/// An f32 parameter of `shape` sharded from `src` (at offset 0) with `config` (null: defaults).
///
/// # Safety
/// `h` and `src` live; `config` null or readable.
unsafe fn f32_param(
    h: *const HprtHsdp,
    name: &std::ffi::CStr,
    shape: &[usize],
    config: *const HprtHsdpParamConfig,
    src: *const HprtDeviceBuffer,
) -> *mut HprtHsdpParam {
    let mut w = ptr::null_mut();
    // SAFETY: the caller's contract.
    ok(unsafe {
        param_create(
            h,
            name,
            shape,
            HprtDtype::F32 as i32,
            config,
            src,
            0,
            &mut w,
        )
    });
    w
}

/// `hprt_hsdp_param_create` of `src` at `offset` with `shape`'s length as its rank: the status,
/// and `*out` written on success.
///
/// # Safety
/// `h` live; `src` null or live; `config` null or readable.
#[allow(clippy::too_many_arguments)] // the C call's own arguments, less the derived rank
unsafe fn param_create(
    h: *const HprtHsdp,
    name: &std::ffi::CStr,
    shape: &[usize],
    dtype: i32,
    config: *const HprtHsdpParamConfig,
    src: *const HprtDeviceBuffer,
    offset: usize,
    out: &mut *mut HprtHsdpParam,
) -> HprtStatus {
    // SAFETY: the caller's contract; `name` and `shape` are live for the call.
    unsafe {
        hprt_hsdp_param_create(
            h,
            name.as_ptr(),
            shape.as_ptr(),
            shape.len(),
            dtype,
            config,
            src,
            offset,
            out,
        )
    }
}

/// Runs `f` on `world` rank threads of one opened cpu platform, each with its own compute
/// stream and world communicator, and checks every device byte was released at the end.
fn run_ranks(world: usize, f: impl Fn(&Rank) + Sync) {
    let mut p = ptr::null_mut();
    // SAFETY: a NUL-terminated request and a valid out-pointer.
    ok(unsafe { hprt_platform_open(c"cpu".as_ptr(), &mut p) });
    // SAFETY: `p` is live.
    let (id, len) = unsafe { unique_id(p) };
    let pa = p as usize;
    std::thread::scope(|sc| {
        for rank in 0..world {
            let (f, id) = (&f, &id[..len]);
            sc.spawn(move || {
                let p = pa as *const HprtPlatform;
                // SAFETY: handles made here, released once after `f`.
                unsafe {
                    let s = stream(p);
                    let comm = join_comm(p, id, rank, world);
                    f(&Rank {
                        p,
                        s,
                        comm,
                        rank,
                        world,
                    });
                    ok(hprt_stream_synchronize(p, s));
                    ok(hprt_comm_destroy(p, comm));
                    ok(hprt_stream_destroy(p, s));
                }
            });
        }
    });
    // Peers drop their references to a rank's buffers as their queued collectives finish.
    let mut stats = HprtMemoryStats::default();
    for _ in 0..2000 {
        // SAFETY: live platform, valid out-pointer.
        ok(unsafe { hprt_platform_memory_stats(p, &mut stats) });
        if stats.device_current == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(stats.device_current, 0, "device bytes left behind");
    // SAFETY: closed once, after every object made from it.
    ok(unsafe { hprt_platform_close(p) });
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
        .collect()
}

/// Shard `k` of `shards` along dim 0 of a `rows × cols` row-major tensor, zero padded.
fn rows_shard(full: &[f32], rows: usize, cols: usize, shards: usize, k: usize) -> Vec<f32> {
    let chunk = rows.div_ceil(shards);
    (0..chunk * cols)
        .map(|i| {
            let row = k * chunk + i / cols;
            if row < rows {
                full[row * cols + i % cols]
            } else {
                0.0
            }
        })
        .collect()
}

fn param_full(n: usize) -> Vec<f32> {
    (0..n).map(|i| 1.0 + i as f32 * 0.5).collect()
}

/// Rank `r`'s gradient: distinct per rank, exact in f32 when summed.
fn grad_of(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (r as f32 + 1.0) * (i as f32 - 3.0) * 0.25)
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}[{i}]: {g} != {w}"
        );
    }
}

fn info(param: *const HprtHsdpParam) -> HprtHsdpParamInfo {
    let mut i = std::mem::MaybeUninit::<HprtHsdpParamInfo>::uninit();
    // SAFETY: live parameter, writable out-pointer; initialized on success.
    unsafe {
        ok(hprt_hsdp_param_info(param, i.as_mut_ptr()));
        i.assume_init()
    }
}
