"""Untrusted compressed bytes and misused arguments: typed errors, never an abort."""

import os
import struct

import numpy as np
import pytest

import hprt

K1 = 0x9E3779B97F4A7C15
K2 = 0xD6E8FEB86659FD93
MASK = (1 << 64) - 1


def checksum(data: bytes) -> int:
    """The format's checksum (compress/FORMAT.md, "Checksum")."""
    padded = data + bytes(-len(data) % 8)
    h = 0
    for i, (w,) in enumerate(struct.iter_unpack("<Q", padded)):
        z = ((w ^ (i * K1 & MASK)) * K2) & MASK
        h = (h + (z ^ (z >> 29))) & MASK
    z = ((h ^ len(data)) * K1) & MASK
    return z ^ (z >> 31)


def constant_bomb(chunks: int, chunk_elems: int = 1 << 24) -> bytes:
    """`chunks` constant f32 chunks of `chunk_elems` elements: 20 bytes per 64 MiB declared."""
    head = bytearray(b"HPRZ" + struct.pack("<HBBB3xIQQQ", 1, 1, 8, 12, chunk_elems,
                                           chunks * chunk_elems, chunks * 4, 0))
    table = b"".join(struct.pack("<IB3xQ", 4, 3, 0) for _ in range(chunks))
    prefix = checksum(bytes(head)) ^ _rotl(checksum(table), 17)
    head[32:40] = struct.pack("<Q", prefix)
    return bytes(head) + table + bytes(4 * chunks)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def test_a_decoded_size_bomb_is_refused_within_max_output():
    bomb = constant_bomb(400)
    assert len(bomb) == 8040
    assert hprt.compressed_info(bomb)["raw_bytes"] == 25 << 30
    with pytest.raises(hprt.CompressError) as e:
        hprt.decompress(bomb, max_output=1 << 30)
    assert e.value.status == "HP_COMPRESS_OUTPUT_TOO_LARGE"
    assert "26843545600" in str(e.value)


def test_under_the_limit_the_output_is_checked_chunk_by_chunk():
    # Valid prefix, wrong chunk checksums (zero): decoding fails at the first chunk.
    bomb = constant_bomb(2, chunk_elems=1 << 10)
    with pytest.raises(hprt.CompressError) as e:
        hprt.decompress(bomb, max_output=1 << 20)
    assert e.value.status == "HP_COMPRESS_CORRUPT"


def test_decompress_into_requires_the_encoded_dtype_not_just_its_size():
    x = np.linspace(-3, 3, 4096, dtype=np.float16)
    blob = hprt.compress(x)
    same_size = np.empty(4096, dtype=np.int16)
    with pytest.raises(hprt.InvalidValueError):
        hprt.decompress_into(blob, same_size)
    torch = pytest.importorskip("torch")
    bf16 = torch.empty(4096, dtype=torch.bfloat16)
    with pytest.raises(hprt.InvalidValueError):
        hprt.decompress_into(blob, bf16)
    out = np.empty_like(x)
    hprt.decompress_into(blob, out)
    assert out.tobytes() == x.tobytes()


def test_non_zero_mantissa_padding_is_corrupt():
    # 813 bf16 elements of one exponent: single-symbol, 712 mantissa bytes with 5 padding bits.
    torch = pytest.importorskip("torch")
    vals = torch.tensor([0x3F80 | (i * 9 % 128) for i in range(813)], dtype=torch.int16)
    blob = bytearray(hprt.compress(vals.view(torch.bfloat16)))
    assert hprt.compressed_info(bytes(blob))["version"] == 2
    # Format v2: 48-byte header, 64-byte presence bitmap (512 bf16 symbols), one 2-byte
    # frequency, one 4-byte block length; then the block's mantissas, its rANS words (none
    # for a single symbol) and 128 bytes of final states.
    mant_end = 48 + 64 + 2 + 4 + 712
    assert len(blob) == mant_end + 128
    blob[mant_end - 1] ^= 0x80
    with pytest.raises(hprt.CompressError) as e:
        hprt.decompress(bytes(blob))
    assert "padding" in str(e.value)


@pytest.mark.parametrize("shape", [[2**40], [2**30], [2**64 - 1], [2**33, 2**33]])
def test_an_oversized_device_mesh_is_an_error_not_an_abort(shape):
    with pytest.raises(hprt.HprtError) as e:
        hprt.DeviceMesh(shape)
    assert e.value.status == "HP_HSDP_INVALID_MESH"
    assert "mesh size limit" in str(e.value)


def test_a_corrupt_bomb_costs_no_resident_memory_for_its_declared_output():
    """360 bytes declaring 1 GiB, every chunk checksum wrong: the decoder stops at the first
    chunk. The output's pages are untouched until decoded into (it zero-filled all of them
    first: 1 GiB resident for nothing)."""
    import subprocess
    import sys

    code = f"""
import resource, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import hprt
from test_untrusted_input import constant_bomb
bomb = constant_bomb(16)
assert len(bomb) == 360 and hprt.compressed_info(bomb)["raw_bytes"] == 1 << 30
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    hprt.decompress(bomb)
except hprt.CompressError as e:
    assert e.status == "HP_COMPRESS_CORRUPT", e
else:
    raise AssertionError("decoded a corrupt encoding")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown_kib = int(out.stdout.split()[-1])
    # The first chunk (64 MiB) is decoded before its checksum fails; nothing beyond it.
    assert grown_kib < 160 << 10, f"{grown_kib} KiB resident for a 360-byte corrupt file"


def test_a_refused_output_allocation_names_its_size():
    bomb = constant_bomb(4000)  # 250 GiB declared: more than any CI machine maps
    with pytest.raises(MemoryError) as e:
        hprt.decompress(bomb)
    assert str(e.value) == f"HP_ERROR_OUT_OF_MEMORY: cannot allocate {250 << 30} host bytes " \
        "for the decoded output (decompress(blob, max_output=...) refuses it before allocating)"


@pytest.mark.parametrize("name", ["F32", "bf16 ", " f32", "Float32", "BFLOAT16", "torch.F16", "f 32"])
def test_dtype_names_are_exact(name):
    with pytest.raises(hprt.InvalidValueError) as e:
        hprt.compress_bytes(bytes(8), name)
    assert "unknown dtype" in str(e.value)
    p = hprt.cpu_platform(device_memory=1 << 10)
    with pytest.raises(hprt.InvalidValueError):
        p.alloc_device(8).view(name, [2])


@pytest.mark.parametrize("name", ["Host_stage", "host-stage", " off", "OFF", "none"])
def test_compression_names_are_exact(name):
    """ISSUE 31 item 5: every enum name is parsed by its one FromStr, spelled exactly."""
    p = hprt.cpu_platform(device_memory=1 << 10)
    with pytest.raises(hprt.InvalidValueError) as e:
        hprt.SwapManager(p, compression=name)
    assert "unknown compression" in str(e.value)
    for good in ["off", "device", "host_stage", "auto"]:
        hprt.SwapManager(p, compression=good)


@pytest.mark.parametrize("name", ["f32", "float32", "torch.float32", "float", "bf16", "torch.bfloat16",
                                  "f16", "half", "float16"])
def test_exact_dtype_names_are_accepted(name):
    assert hprt.compressed_info(hprt.compress_bytes(bytes(8), name))["raw_bytes"] == 8
