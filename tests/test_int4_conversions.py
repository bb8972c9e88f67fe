"""The CUDA kernels' exact int4 conversions, emulated bit for bit on the CPU: the byte-permute lookups of
ffi/cuda/int4_e4m3.cuh (int4 -> e4m3 for the fp8 MMAs) and the LOP3 + f16 sequence of ffi/cuda/int4_f16.cuh
(int4 -> f16 for the f16 MMAs), with the tables and magic numbers read from those headers, against ml_dtypes'
e4m3 and float16 encodings of every code -8..7 in every nibble position. The GPU tests run the real kernels; this
file catches a wrong table byte or magic number on a machine without a GPU.
"""

import pathlib
import re

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
E4M3 = (ROOT / "ffi/cuda/int4_e4m3.cuh").read_text()
F16 = (ROOT / "ffi/cuda/int4_f16.cuh").read_text()


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode), elementwise over uint32 arrays: byte i of the result is byte (sel_i & 7) of
    {b, a} (a = bytes 0..3), or that byte's sign replicated where bit 3 of the 4-bit selector sel_i is set; only
    the selector's low 16 bits count."""
    a, b, sel = (np.asarray(v, np.uint64) for v in (a, b, sel))
    pool = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        s = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> ((s & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(s & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _tables():
    """(pos, neg) table word pairs of Int4E4m3Lookups, as written in the header."""
    found = re.findall(r'prmt\.b32 %0, %1, %2, %3;" : "=r"\((pos|neg)\) : "r"\((0x[0-9A-Fa-f]+)u\), "r"\((0x[0-9A-Fa-f]+)u\)',
                       E4M3)
    tables = {name: (int(lo, 16), int(hi, 16)) for name, lo, hi in found}
    assert set(tables) == {"pos", "neg"}, found
    return tables["pos"], tables["neg"]


def _words(codes):
    """Eight int4 codes per row (two's complement nibbles, code j in nibble j) -> uint32 words."""
    nib = (np.asarray(codes, np.int64) & 0xF).astype(np.uint64)
    return (nib << (np.uint64(4) * np.arange(8, dtype=np.uint64))).sum(axis=-1).astype(np.uint32)


def _all_code_words(rng):
    """Codes [rows, 8] and their words: every code in all eight positions at once, then fresh random mixes."""
    codes = rng.integers(-8, 8, size=(4096, 8))
    codes[:16, :] = np.arange(-8, 8)[:, None]  # each code in all eight positions at once
    return codes, _words(codes)


def test_e4m3_tables_hold_every_int4_code():
    (p0, p1), (n0, n1) = _tables()
    pos = np.frombuffer(np.array([p0, p1], "<u4").tobytes(), np.uint8)
    neg = np.frombuffer(np.array([n0, n1], "<u4").tobytes(), np.uint8)
    want = lambda values: np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(pos, want(np.arange(0, 8)))
    np.testing.assert_array_equal(neg, want(np.arange(-8, 0)))


def test_eight_codes_to_e4m3_bytes(rng):
    """Int4x8ToE4m3: idx = w & 0x77777777, sign = w & 0x88888888; lookups by idx and idx >> 16; picks by
    (sign >> 1) + 0x3210 and (sign >> 17) + 0x3210 (codes 0..3 in lo, 4..7 in hi)."""
    assert "(sign >> 1) + 0x3210u" in E4M3 and "(sign >> 17) + 0x3210u" in E4M3
    (p0, p1), (n0, n1) = _tables()
    codes, w = _all_code_words(rng)
    idx, sign = w & np.uint32(0x77777777), w & np.uint32(0x88888888)
    lo = prmt(prmt(p0, p1, idx), prmt(n0, n1, idx), (sign >> np.uint32(1)) + np.uint32(0x3210))
    hi = prmt(prmt(p0, p1, idx >> np.uint32(16)), prmt(n0, n1, idx >> np.uint32(16)),
              (sign >> np.uint32(17)) + np.uint32(0x3210))
    got = np.stack([lo, hi], axis=-1).astype("<u4").view(np.uint8).reshape(-1, 8)
    want = codes.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)


def test_four_codes_to_e4m3_bytes_ignore_the_upper_half(rng):
    """Int4x4ToE4m3 reads codes from bits 0..15 only (callers pass words with other codes above)."""
    assert "((nibbles & 0x8888u) >> 1) + 0x3210u" in E4M3
    (p0, p1), (n0, n1) = _tables()
    codes, w = _all_code_words(rng)
    idx = w & np.uint32(0x7777)
    got = prmt(prmt(p0, p1, idx), prmt(n0, n1, idx), ((w & np.uint32(0x8888)) >> np.uint32(1)) + np.uint32(0x3210))
    want = codes[:, :4].astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got.astype("<u4").view(np.uint8).reshape(-1, 4), want)


def _f16_constants():
    lop = re.findall(r'lop3\.b32 %0, %1, %2, %3, 0x6a;" : "=r"\((\w+)\) : "r"\((w2?)\), "r"\((0x[0-9A-Fa-f]+)u\), '
                     r'"r"\((0x[0-9A-Fa-f]+)u\)', F16)
    sub = re.findall(r'sub\.rn\.f16x2 %0, %1, %2;" : "=r"\(f\[(\d)\]\) : "r"\((\w+)\), "r"\((0x[0-9A-Fa-f]+)u\)', F16)
    fma = re.findall(r'fma\.rn\.f16x2 %0, %1, %2, %3;" : "=r"\(f\[(\d)\]\) : "r"\((\w+)\), "r"\((0x[0-9A-Fa-f]+)u\), '
                     r'"r"\((0x[0-9A-Fa-f]+)u\)', F16)
    assert len(lop) == 4 and len(sub) == 2 and len(fma) == 2, (lop, sub, fma)
    return ({name: (src, int(mask, 16), int(magic, 16)) for name, src, mask, magic in lop},
            {int(i): ("sub", src, int(c, 16)) for i, src, c in sub} | {int(i): ("fma", src, int(m, 16), int(a, 16))
                                                                      for i, src, m, a in fma})


def _halves(words):
    """uint32 words -> float64 [.., 2] of their two f16 halves (low half first)."""
    return np.atleast_1d(np.asarray(words, "<u4")).view(np.float16).reshape(*np.shape(words), 2).astype(np.float64)


def _f16x2(op, a, *consts):
    """f16x2 sub (a - c0) or fma (a * c0 + c1) on uint32 words, rounded once to f16 as .rn does (the float64
    operations on f16 values here are exact)."""
    x = _halves(a)
    c = [_halves(np.uint32(v)) for v in consts]
    r = x - c[0] if op == "sub" else x * c[0] + c[1]
    return r.astype(np.float16).view("<u4").reshape(np.shape(a))


def test_eight_codes_to_f16_pairs(rng):
    """Int4x8ToF16: each pair f[j] = (code j, code j + 4) as f16, from w and w >> 8 (or its high word of w * 2^24)."""
    lops, outs = _f16_constants()
    codes, w = _all_code_words(rng)
    src = {"w": w, "w2": w >> np.uint32(8)}
    regs = {name: (src[s] & np.uint32(mask)) ^ np.uint32(magic) for name, (s, mask, magic) in lops.items()}
    for j in range(4):
        op, reg, *consts = outs[j]
        got = _halves(_f16x2(op, regs[reg], *consts)).reshape(-1, 2)
        np.testing.assert_array_equal(got, codes[:, [j, j + 4]].astype(np.float64), err_msg=f"f[{j}]")
