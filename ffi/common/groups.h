// Rows per expert from device-side group sizes, with the clamping rule every kernel shares:
// negative sizes count as 0 and the running end is cut at M, so no row outside [0, M) is touched.
// Expert e owns rows [end(e-1), end(e)); rows at or past end(E-1) are padding (output 0).
#pragma once

#include <cstdint>

#include "formats.h"

namespace jax_w4a8 {

W4A8_HD int64_t NextGroupEnd(int64_t prev_end, int32_t size, int64_t m) {
  const int64_t s = size < 0 ? 0 : static_cast<int64_t>(size);
  const int64_t end = prev_end + (s > m ? m : s);
  return end > m ? m : end;
}

// Index of the first entry of the ascending `ends[0..e)` that is greater than `row` (e if none).
W4A8_HD int64_t ExpertOfRow(const int64_t* ends, int64_t e, int64_t row) {
  int64_t lo = 0, hi = e;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (ends[mid] > row) hi = mid; else lo = mid + 1;
  }
  return lo;
}

}  // namespace jax_w4a8
