// ops.w4a8_grouped_gemm's prefill path (kernel "cutlass", bf16 output): the int4 weights of the experts that
// have rows are converted to e4m3 once per call (exact: every int4 value is an e4m3 value), then CUTLASS 4.2's
// Hopper grouped FP8 GEMM with blockwise scaling runs all experts in one persistent launch
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise). Same math as SPEC 4.1 and the library's own
// kernels: e4m3 x e4m3 wgmma into a fresh float32 accumulator per 128-K group, then sa[m, g] * sw[e, n, g]
// applied with float32 FMAs, one bf16 rounding. Scales have per-row granularity on both sides; small
// kernels write them as float32 in the rows-fastest layouts CUTLASS loads best (any x_scale kind, float32 or
// bfloat16 w_scale).
//
// Tiles of 128 tokens x 128 weight rows x 128 K, two consumer warpgroups, no clusters (H200, same probe:
// 1 x 2 clusters no faster; the pingpong schedule 4x slower). Nothing is synchronised with the host: a
// one-block kernel turns group_sizes (clamped like every kernel here, common/groups.h) into the per-expert
// problem sizes, pointers and strides CUTLASS's group scheduler reads on the device; experts without rows get an empty problem and no conversion; rows
// past the clamped total are zeroed. The e4m3 weights take E x N x K bytes of scratch, so experts are run
// in chunks of `experts_per_chunk` (jax_w4a8.tiling bounds the scratch), one conversion + GEMM each.
#include "w4a8_grouped_cutlass.cuh"

#include <algorithm>

#include "../common/formats.h"
#include "../common/groups.h"
#include "hopper_gemm.cuh"
#include "int4_e4m3.cuh"

#if defined(JAX_W4A8_HAS_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass_smem.cuh"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace jax_w4a8 {
namespace {

size_t Align256(size_t v) { return (v + 255) / 256 * 256; }

struct ScratchLayout {
  size_t w8 = 0, sfb = 0, sfa = 0, arrays = 0, workspace = 0, total = 0;
};

ScratchLayout LayoutOf(int64_t m, int64_t e, int64_t n, int64_t k, int64_t chunk) {
  ScratchLayout s;
  const int64_t g = k / kGroup;
  size_t off = 0;
  s.w8 = off;
  off += Align256(static_cast<size_t>(chunk * n * k));
  s.sfb = off;
  off += Align256(static_cast<size_t>(chunk * n * g) * 4);
  s.sfa = off;
  off += Align256(static_cast<size_t>(m * g) * 4);
  s.arrays = off;
  off += Align256(static_cast<size_t>(e) * kW4a8CutlassArrayBytesPerExpert);
  s.workspace = off;
  off += kW4a8CutlassWorkspaceBytes;
  s.total = off;
  return s;
}

}  // namespace

size_t W4a8CutlassScratchBytes(int64_t m, int64_t e, int64_t n, int64_t k, int64_t experts_per_chunk) {
  return LayoutOf(m, e, n, k, experts_per_chunk).total;
}

#if defined(JAX_W4A8_HAS_CUTLASS)
namespace {
using namespace cute;

// One pass over the experts' int4 weights: 8 codes (a 32-bit word) -> 8 e4m3 bytes (int4_e4m3.cuh).
__global__ void __launch_bounds__(256) ConvertInt4ToE4m3(const int8_t* __restrict__ w, const int* __restrict__ rows,
                                                         int64_t e0, int64_t units, uint8_t* __restrict__ w8) {
  const int64_t ex = e0 + blockIdx.y;
  if (rows[ex] == 0) return;  // an expert without rows: its weights are never read
  const uint4* src = reinterpret_cast<const uint4*>(w) + ex * units;
  uint4* dst = reinterpret_cast<uint4*>(w8) + blockIdx.y * 2 * units;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < units; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(src + i);
    uint4 a, b;
    Int4x8ToE4m3(v.x, a.x, a.y);
    Int4x8ToE4m3(v.y, a.z, a.w);
    Int4x8ToE4m3(v.z, b.x, b.y);
    Int4x8ToE4m3(v.w, b.z, b.w);
    dst[2 * i] = a;
    dst[2 * i + 1] = b;
  }
}

// Weight scales of the chunk's experts with rows as float32 [slot, G, N] (N fastest: CUTLASS's MN-major
// layout, which its producer warp loads with coalesced copies).
__global__ void TransposeWeightScales(const void* __restrict__ ws, bool bf16, const int* __restrict__ rows, int64_t e0,
                                      int64_t n, int64_t g, float* __restrict__ out) {
  const int64_t ex = e0 + blockIdx.y;
  if (rows[ex] == 0) return;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * g; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t kb = i / n, col = i % n, src = (ex * n + col) * g + kb;
    out[blockIdx.y * n * g + i] =
        bf16 ? Bf16BitsToFloat(static_cast<const uint16_t*>(ws)[src]) : static_cast<const float*>(ws)[src];
  }
}

// Activation scales as float32, per expert [G, rows] (rows fastest) at offset start * G: the MN-major
// layout CUTLASS expects of each group. x_scale kind: 0 per tensor, 1 per token, 2 per token and group.
__global__ void TransposeActScales(const float* __restrict__ xs, int kind, const int64_t* __restrict__ ends, int64_t e,
                                   int64_t m, int64_t g, float* __restrict__ out) {
  const int64_t total = ends[e - 1];
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * g; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t kb = i / m, row = i % m;
    if (row >= total) continue;
    const int64_t ex = ExpertOfRow(ends, e, row);
    const int64_t start = ex == 0 ? 0 : ends[ex - 1], rows = ends[ex] - start;
    out[start * g + kb * rows + (row - start)] = kind == 0 ? xs[0] : kind == 1 ? xs[row] : xs[row * g + kb];
  }
}

// Zeroes the rows at or past the clamped total (padding), 16 bytes per store; N is a multiple of 8.
__global__ void ZeroPaddingRows(const int64_t* __restrict__ total, int64_t m, int64_t n, uint4* __restrict__ out) {
  const int64_t per_row = n / 8, end = m * per_row;
  for (int64_t i = *total * per_row + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < end;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}


using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // x rows, K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // w8 [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // out rows, N contiguous
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
// One scale per row and 128-K group on both sides, rows fastest (transposed into the scratch: H200, same probe,
// gate+up at 128 rows per expert 281 vs 322 us with the given K-fastest layouts, at 512 rows 1006 vs 1037).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, 8, ElementD, LayoutD*, 8,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, 16, ElementB,
    cute::tuple<LayoutB*, LayoutSFB*>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using Shape3 = typename ProblemShape::UnderlyingProblemShape;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

// The per-expert arrays CUTLASS's group scheduler and collectives read on the device.
struct GroupArrays {
  Shape3* shapes;
  const ElementA** a;
  const ElementB** b;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  int* rows;      // clamped rows per expert (0: no conversion, empty problem)
  int64_t* ends;  // clamped end row of each expert: ends[E - 1] is the total, rows past it are padding
};

constexpr size_t Align16(size_t v) { return (v + 15) / 16 * 16; }

// Carves the arrays out of `base`; returns the bytes used (checked against the region by the caller).
size_t CarveArrays(uint8_t* base, int64_t e, GroupArrays* out) {
  GroupArrays& g = *out;
  size_t off = 0;
  auto take = [&](size_t bytes) { uint8_t* p = base + off; off = Align16(off + bytes); return p; };
  g.ends = reinterpret_cast<int64_t*>(take(8 * e));
  g.shapes = reinterpret_cast<Shape3*>(take(sizeof(Shape3) * e));
  g.a = reinterpret_cast<const ElementA**>(take(8 * e));
  g.b = reinterpret_cast<const ElementB**>(take(8 * e));
  g.d = reinterpret_cast<ElementD**>(take(8 * e));
  g.sfa = reinterpret_cast<const float**>(take(8 * e));
  g.sfb = reinterpret_cast<const float**>(take(8 * e));
  g.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * e));
  g.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * e));
  g.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * e));
  g.rows = reinterpret_cast<int*>(take(4 * e));
  return off;
}

struct PrepareArgs {
  GroupArrays g;
  const int32_t* group_sizes;
  const uint8_t* x;
  const uint8_t* w8;
  const float* sfa;  // float32, per expert [G, rows] at start * G
  const float* sfb;  // float32 [chunk, G, N]
  void* out;
  int64_t m, n, k, e, chunk;
};

// One block: a saturating prefix sum over group_sizes (min(a + b, M) of non-negative terms is associative),
// then every expert's problem, pointers and strides.
__global__ void __launch_bounds__(1024) PrepareGroups(PrepareArgs a) {
  __shared__ int64_t scan[1024];
  __shared__ int64_t carry;
  const int t = threadIdx.x;
  const int64_t g = a.k / kGroup;
  if (t == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < a.e; base += 1024) {
    const int64_t ex = base + t;
    const int32_t s = ex < a.e ? a.group_sizes[ex] : 0;
    scan[t] = s < 0 ? 0 : (s > a.m ? a.m : s);
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {
      const int64_t other = t >= off ? scan[t - off] : 0;
      __syncthreads();
      scan[t] = min(scan[t] + other, a.m);
      __syncthreads();
    }
    const int64_t c = carry;
    const int64_t end = min(c + scan[t], a.m);
    const int64_t start = t == 0 ? c : min(c + scan[t - 1], a.m);
    if (ex < a.e) {
      const int64_t rows = end - start;
      const int64_t slot = ex % a.chunk;
      a.g.rows[ex] = static_cast<int>(rows);
      a.g.ends[ex] = end;
      a.g.shapes[ex] = Shape3{static_cast<int>(rows), static_cast<int>(a.n), static_cast<int>(a.k)};
      a.g.a[ex] = reinterpret_cast<const ElementA*>(a.x + start * a.k);
      a.g.b[ex] = reinterpret_cast<const ElementB*>(a.w8 + slot * a.n * a.k);
      a.g.d[ex] = reinterpret_cast<ElementD*>(a.out) + start * a.n;
      a.g.sfa[ex] = a.sfa + start * g;
      a.g.sfb[ex] = a.sfb + slot * a.n * g;
      StrideA sa{};
      StrideB sb{};
      StrideD sd{};
      get<0>(sa) = a.k;  // x rows [M, K]
      get<0>(sb) = a.k;  // w8 [N, K]
      get<0>(sd) = a.n;  // out rows [M, N]
      a.g.stride_a[ex] = sa;
      a.g.stride_b[ex] = sb;
      a.g.stride_d[ex] = sd;
    }
    __syncthreads();
    if (t == 1023) carry = end;
    __syncthreads();
  }
}

}  // namespace

bool W4a8CutlassBuilt() { return true; }

std::string W4a8CutlassUnsupported(int64_t m, int64_t e, int64_t n, int64_t k, int64_t experts_per_chunk) {
  if (n % 8) return "N must be a multiple of 8 (bf16 TMA store)";
  if (k % kGroup) return "K must be a multiple of 128";
  // The conversion kernels put a chunk's experts on the grid's y axis (at most 65535).
  if (experts_per_chunk < 1 || experts_per_chunk > e || experts_per_chunk > 65535)
    return "experts_per_chunk must be in [1, min(E, 65535)]";
  // Problem sizes and CUTLASS's group strides are int32.
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31) || e >= (int64_t{1} << 31))
    return "dimensions too large for its 32-bit problem sizes";
  return {};
}

bool LaunchW4a8Cutlass(const W4a8CutlassParams& p, cudaStream_t stream, std::string* why) {
  if (std::string u = W4a8CutlassUnsupported(p.m, p.e, p.n, p.k, p.experts_per_chunk); !u.empty()) {
    *why = u;
    return false;
  }
  const ScratchLayout s = LayoutOf(p.m, p.e, p.n, p.k, p.experts_per_chunk);
  if (p.scratch_bytes < s.total) { *why = "scratch output too small for the CUTLASS plan"; return false; }
  if (!EnsureCutlassSmemOptIn<Kernel>()) { *why = "shared-memory opt-in failed"; return false; }
  auto* base = static_cast<uint8_t*>(p.scratch);
  const int64_t g = p.k / kGroup, chunk = p.experts_per_chunk;
  const int sms = CurrentSmCount();
  int dev = 0;
  cudaGetDevice(&dev);
  uint8_t* w8 = base + s.w8;
  float* sfb = reinterpret_cast<float*>(base + s.sfb);
  float* sfa = reinterpret_cast<float*>(base + s.sfa);
  GroupArrays arrays;
  if (CarveArrays(base + s.arrays, p.e, &arrays) > s.workspace - s.arrays) {
    *why = "argument arrays exceed their scratch region (kW4a8CutlassArrayBytesPerExpert)";
    return false;
  }
  void* workspace = base + s.workspace;

  PrepareArgs pa{arrays, p.group_sizes, p.x, w8, sfa, sfb, p.out, p.m, p.n, p.k, p.e, chunk};
  PrepareGroups<<<1, 1024, 0, stream>>>(pa);
  const int act_blocks = static_cast<int>(std::min<int64_t>((p.m * g + 255) / 256, 4 * int64_t{sms}));
  TransposeActScales<<<std::max(act_blocks, 1), 256, 0, stream>>>(p.x_scale, p.x_scale_kind, arrays.ends, p.e, p.m, g,
                                                                   sfa);
  ZeroPaddingRows<<<2 * sms, 256, 0, stream>>>(arrays.ends + p.e - 1, p.m, p.n, static_cast<uint4*>(p.out));
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { *why = cudaGetErrorString(err); return false; }

  const int64_t units = p.n * p.k / 32;  // 16-byte pieces of one expert's packed int4 weights
  for (int64_t e0 = 0; e0 < p.e; e0 += chunk) {
    const int64_t cnt = std::min(chunk, p.e - e0);
    // About four blocks per SM in all: H200, 32 experts' gate+up weights, 16 blocks per expert 3.81 TB/s
    // (a plain copy 3.92), 33 blocks 2.79, 66 blocks 2.65 (more concurrent streams, worse DRAM locality).
    const unsigned bx = static_cast<unsigned>(
        std::min<int64_t>((units + 255) / 256, std::max<int64_t>(4 * int64_t{sms} / cnt, 1)));
    ConvertInt4ToE4m3<<<dim3(bx, static_cast<unsigned>(cnt)), 256, 0, stream>>>(p.w, arrays.rows, e0, units, w8);
    const unsigned sx = static_cast<unsigned>(std::min<int64_t>((p.n * g + 255) / 256, std::max<int64_t>(bx / 2, 1)));
    TransposeWeightScales<<<dim3(sx, static_cast<unsigned>(cnt)), 256, 0, stream>>>(p.w_scale, p.w_scale_bf16,
                                                                                      arrays.rows, e0, p.n, g, sfb);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { *why = cudaGetErrorString(err); return false; }

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(cnt), arrays.shapes + e0, nullptr},
        {arrays.a + e0, arrays.stride_a + e0, arrays.b + e0, arrays.stride_b + e0, arrays.sfa + e0, nullptr,
         arrays.sfb + e0, nullptr},
        {{}, nullptr, arrays.stride_d + e0, arrays.d + e0, arrays.stride_d + e0}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.device_id = dev;
    args.hw_info.sm_count = sms;
    args.scheduler.max_swizzle_size = 1;
    if (Gemm::get_workspace_size(args) > kW4a8CutlassWorkspaceBytes) { *why = "CUTLASS workspace too large"; return false; }
    if (Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess) {
      *why = "CUTLASS workspace initialisation failed";
      return false;
    }
    auto params = Kernel::to_underlying_arguments(args, workspace);
    if (const cutlass::Status status = Gemm::run(params, stream); status != cutlass::Status::kSuccess) {
      *why = std::string("CUTLASS launch failed: ") + cutlassGetStatusString(status);
      return false;
    }
  }
  return true;
}

#else  // built without CUTLASS headers

bool W4a8CutlassBuilt() { return false; }
std::string W4a8CutlassUnsupported(int64_t, int64_t, int64_t, int64_t, int64_t) {
  return "the library was built without CUTLASS (pip install nvidia-cutlass, then rebuild)";
}
bool LaunchW4a8Cutlass(const W4a8CutlassParams&, cudaStream_t, std::string* why) {
  *why = W4a8CutlassUnsupported(0, 0, 0, 0, 0);
  return false;
}

#endif

}  // namespace jax_w4a8
