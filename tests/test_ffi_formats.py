"""ffi/common/formats.h compiled for the host (the handlers' shared number formats): exhaustive checks of the helpers
whose exactness a kernel relies on, against the plain arithmetic they replace."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every float32 from 1e-4 (the kernels' floor for a group's largest magnitude) up to +inf, and every UE8M0 value.
PROGRAM = r"""
#include <cstdio>
#include "formats.h"
using namespace jax_w4a8;
int main() {
  unsigned long long scale_bad = 0, recip_bad = 0, n = 0;
  for (uint32_t b = FloatToBits(1e-4f); b <= 0x7F800000u; ++b, ++n) {
    const float amax = BitsToFloat(b);
    if (FloatToBits(Ue8m0ScaleForE4m3(amax)) != FloatToBits(CeilToUe8m0(amax / 448.0f)) && scale_bad++ < 5)
      std::printf("scale %08x\n", b);
  }
  for (uint32_t e = 1; e <= 254; ++e) {
    const float s = BitsToFloat(e << 23);
    if (FloatToBits(Ue8m0Reciprocal(s)) != FloatToBits(1.0f / s) && recip_bad++ < 5) std::printf("recip %u\n", e);
  }
  std::printf("checked %llu scale_bad %llu recip_bad %llu\n", n, scale_bad, recip_bad);
  return scale_bad || recip_bad;
}
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_ue8m0_scale_and_reciprocal_from_bits_equal_the_divisions_for_every_float(tmp_path):
    src, exe = tmp_path / "formats_check.cc", tmp_path / "formats_check"
    src.write_text(PROGRAM)
    # No -ffast-math: the reference divisions must round as IEEE division does (SSE on x86-64).
    subprocess.run(["c++", "-O2", "-std=c++17", "-I", os.path.join(ROOT, "ffi", "common"), str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout
    assert "scale_bad 0 recip_bad 0" in result.stdout
    assert int(result.stdout.split("checked ")[1].split()[0]) > 1_000_000_000  # the whole range ran
