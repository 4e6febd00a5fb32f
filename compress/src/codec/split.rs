//! Per-dtype split of an element into its sign+exponent symbol and its raw mantissa bits, and
//! the packing of mantissas: a little-endian bit stream, `w` bits per element, so a group of
//! eight elements fills exactly `w` bytes.

use crate::format::CodecDType;

/// A floating-point layout, read as an unsigned integer of `BYTES` little-endian bytes.
pub(crate) trait Elem: Send + Sync + 'static {
    const DTYPE: CodecDType;
    const BYTES: usize;
    const MANT_BITS: u32;
    const SYM_BITS: u32 = Self::DTYPE.symbol_bits();
    const ALPHABET: usize = 1 << Self::SYM_BITS;
    const MANT_MASK: u32 = (1 << Self::MANT_BITS) - 1;

    fn load(b: &[u8]) -> u32;
    fn store(v: u32, out: &mut [u8]);

    #[inline(always)]
    fn symbol(v: u32) -> usize {
        (v >> Self::MANT_BITS) as usize
    }
}

pub(crate) struct F32;
pub(crate) struct F16;
pub(crate) struct BF16;

impl Elem for F32 {
    const DTYPE: CodecDType = CodecDType::F32;
    const BYTES: usize = 4;
    const MANT_BITS: u32 = 23;
    #[inline(always)]
    fn load(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    #[inline(always)]
    fn store(v: u32, out: &mut [u8]) {
        out[..4].copy_from_slice(&v.to_le_bytes());
    }
}

impl Elem for F16 {
    const DTYPE: CodecDType = CodecDType::F16;
    const BYTES: usize = 2;
    const MANT_BITS: u32 = 10;
    #[inline(always)]
    fn load(b: &[u8]) -> u32 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    }
    #[inline(always)]
    fn store(v: u32, out: &mut [u8]) {
        out[..2].copy_from_slice(&(v as u16).to_le_bytes());
    }
}

impl Elem for BF16 {
    const DTYPE: CodecDType = CodecDType::BF16;
    const BYTES: usize = 2;
    const MANT_BITS: u32 = 7;
    #[inline(always)]
    fn load(b: &[u8]) -> u32 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    }
    #[inline(always)]
    fn store(v: u32, out: &mut [u8]) {
        out[..2].copy_from_slice(&(v as u16).to_le_bytes());
    }
}

pub(crate) use crate::format::mantissa_len;

/// Packs eight mantissas of `E::MANT_BITS` bits into the first `E::MANT_BITS` bytes of `out`.
#[inline(always)]
pub(crate) fn pack8<E: Elem>(m: &[u32; 8], out: &mut [u8]) {
    let w = E::MANT_BITS as usize;
    if 8 * w <= 64 {
        // bf16: the group fits one u64 (constant branches per dtype).
        let mut acc = 0u64;
        for (k, &v) in m.iter().enumerate() {
            acc |= (v as u64) << (k * w);
        }
        out[..w].copy_from_slice(&acc.to_le_bytes()[..w]);
        return;
    }
    if 8 * w <= 128 {
        // f16: one u128.
        let mut acc = 0u128;
        for (k, &v) in m.iter().enumerate() {
            acc |= (v as u128) << (k * w);
        }
        out[..w].copy_from_slice(&acc.to_le_bytes()[..w]);
        return;
    }
    let mut acc = [0u64; 3];
    for (k, &v) in m.iter().enumerate() {
        let bit = k * w;
        let (wi, sh) = (bit / 64, bit % 64);
        acc[wi] |= (v as u64) << sh;
        if sh + w > 64 {
            acc[wi + 1] |= (v as u64) >> (64 - sh);
        }
    }
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&acc[0].to_le_bytes());
    bytes[8..16].copy_from_slice(&acc[1].to_le_bytes());
    bytes[16..].copy_from_slice(&acc[2].to_le_bytes());
    out[..w].copy_from_slice(&bytes[..w]);
}

/// Inverse of [`pack8`]: eight mantissas from the first `E::MANT_BITS` bytes of `src`.
#[inline(always)]
pub(crate) fn unpack8<E: Elem>(src: &[u8]) -> [u32; 8] {
    let w = E::MANT_BITS as usize;
    if 8 * w <= 64 {
        let mut bytes = [0u8; 8];
        bytes[..w].copy_from_slice(&src[..w]);
        let acc = u64::from_le_bytes(bytes);
        return std::array::from_fn(|k| (acc >> (k * w)) as u32 & E::MANT_MASK);
    }
    if 8 * w <= 128 {
        let mut bytes = [0u8; 16];
        bytes[..w].copy_from_slice(&src[..w]);
        let acc = u128::from_le_bytes(bytes);
        return std::array::from_fn(|k| (acc >> (k * w)) as u32 & E::MANT_MASK);
    }
    let mut bytes = [0u8; 24];
    bytes[..w].copy_from_slice(&src[..w]);
    let acc = [
        u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
        u64::from_le_bytes(bytes[16..].try_into().expect("8 bytes")),
    ];
    let mut m = [0u32; 8];
    for (k, v) in m.iter_mut().enumerate() {
        let bit = k * w;
        let (wi, sh) = (bit / 64, bit % 64);
        let mut x = acc[wi] >> sh;
        if sh + w > 64 {
            x |= acc[wi + 1] << (64 - sh);
        }
        *v = x as u32 & E::MANT_MASK;
    }
    m
}

/// The symbol of every element of `src` into `syms` (one per element).
pub(crate) fn symbols_of<E: Elem>(src: &[u8], syms: &mut [u16]) {
    for (s, e) in syms.iter_mut().zip(src.chunks_exact(E::BYTES)) {
        *s = E::symbol(E::load(e)) as u16;
    }
}

/// Packs the mantissas of all elements of `src` into `mant` (exactly
/// `mantissa_len(n, E::MANT_BITS)` bytes).
pub(crate) fn pack_mantissas<E: Elem>(src: &[u8], mant: &mut [u8]) {
    let w = E::MANT_BITS as usize;
    let full = src.len() / (8 * E::BYTES);
    let mut groups = src.chunks_exact(8 * E::BYTES);
    for (grp, o) in (&mut groups).zip(mant.chunks_exact_mut(w)) {
        let m: [u32; 8] = std::array::from_fn(|k| E::load(&grp[k * E::BYTES..]) & E::MANT_MASK);
        pack8::<E>(&m, o);
    }
    let rest = groups.remainder();
    if !rest.is_empty() {
        let mut m = [0u32; 8];
        for (v, e) in m.iter_mut().zip(rest.chunks_exact(E::BYTES)) {
            *v = E::load(e) & E::MANT_MASK;
        }
        pack_tail::<E>(&m[..rest.len() / E::BYTES], &mut mant[full * w..]);
    }
}

/// Writes eight elements `syms[k] << mantissa bits | mantissa k` into `grp` from one packed
/// mantissa group.
#[inline(always)]
pub(crate) fn merge_group<E: Elem>(grp: &mut [u8], syms: &[u16], mant: &[u8]) {
    let m = unpack8::<E>(mant);
    for k in 0..8 {
        E::store(
            ((syms[k] as u32) << E::MANT_BITS) | m[k],
            &mut grp[k * E::BYTES..],
        );
    }
}

/// Packs a final group of fewer than eight mantissas (zero bits fill the last byte).
pub(crate) fn pack_tail<E: Elem>(m: &[u32], out: &mut [u8]) {
    let mut g = [0u32; 8];
    g[..m.len()].copy_from_slice(m);
    let mut buf = [0u8; 24];
    pack8::<E>(&g, &mut buf);
    let len = mantissa_len(m.len(), E::MANT_BITS);
    out[..len].copy_from_slice(&buf[..len]);
}

/// Inverse of [`pack_tail`] for `n < 8` mantissas.
pub(crate) fn unpack_tail<E: Elem>(src: &[u8], n: usize) -> [u32; 8] {
    let mut buf = [0u8; 24];
    let len = mantissa_len(n, E::MANT_BITS);
    buf[..len].copy_from_slice(&src[..len]);
    unpack8::<E>(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<E: Elem>() {
        let m: [u32; 8] =
            std::array::from_fn(|k| (0x5a5a5a5u32.rotate_left(k as u32 * 5)) & E::MANT_MASK);
        let mut out = [0u8; 24];
        pack8::<E>(&m, &mut out);
        assert_eq!(unpack8::<E>(&out), m);
        // The bit stream is element 0 in the lowest bits.
        assert_eq!(
            out[0] as u32 & E::MANT_MASK.min(0xff),
            m[0] & 0xff & E::MANT_MASK
        );
        for n in 1..8 {
            let mut t = [0u8; 24];
            pack_tail::<E>(&m[..n], &mut t);
            assert_eq!(&unpack_tail::<E>(&t, n)[..n], &m[..n]);
        }
    }

    #[test]
    fn mantissa_groups_round_trip_for_every_dtype() {
        round_trip::<F32>();
        round_trip::<F16>();
        round_trip::<BF16>();
    }
}
