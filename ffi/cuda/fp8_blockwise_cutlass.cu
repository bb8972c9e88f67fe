// ops.fp8_einsum's prefill path for recipe (1, 128, 128) with bf16 output: CUTLASS 4.2's Hopper FP8
// blockwise-scaled GEMM (KernelTmaWarpSpecializedCooperativeFP8Blockwise). Same math as SPEC 4.2 and the
// library's own kernels: e4m3 x e4m3 wgmma into a fresh float32 accumulator per 128-K block, then both
// scales applied with float32 FMAs (sa[m, kb] * sw[n / 128, kb]), one bf16 rounding.
//
// Tiles of 128 tokens x 128 weight rows x 128 K, two consumer warpgroups (64 tokens each) on wgmma's A
// side, no clusters (each block loads its own tiles: see ClusterShape), a persistent tile scheduler (no
// split-K, so outputs are bitwise reproducible). The per-head form runs as CUTLASS's batch mode (L = H)
// with the strides of x [M, H, K], w [H, N, K] and out [M, H, N]. H200, same process: M = 4096,
// N = K = 7168 at 1274-1300 TFLOP/s against 916 for the library's 192-token kernel (see tiling.py).
//
// A small kernel first writes the scales as float32 in the layouts CUTLASS loads by TMA: activation
// scales [H, G, ceil4(M)] (M fastest; rows M .. ceil4(M) zero, TMA needs the 16-byte multiple) and, for
// UE8M0 codes, weight scales [H, ceil(N/128), G] (exact powers of two).
#include "fp8_blockwise_cutlass.cuh"

#include <algorithm>

#include "../common/formats.h"
#include "hopper_gemm.cuh"

#if defined(JAX_W4A8_HAS_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass_smem.cuh"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace jax_w4a8 {
namespace {


size_t Align256(size_t v) { return (v + 255) / 256 * 256; }
int64_t Ceil4(int64_t v) { return (v + 3) / 4 * 4; }

__global__ void PrepareBlockwiseScales(const void* x_scale, bool x_ue8m0, const void* w_scale, float* sfa,
                                       float* sfb, int64_t m, int64_t mp, int64_t h, int64_t g, int64_t wsn) {
  const int64_t na = h * g * mp, nb = sfb ? h * wsn * g : 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < na + nb; i += int64_t{gridDim.x} * blockDim.x) {
    if (i < na) {
      const int64_t row = i % mp, hg = i / mp, head = hg / g, grp = hg % g;
      float v = 0.0f;
      if (row < m) {
        const int64_t src = (row * h + head) * g + grp;
        v = x_ue8m0 ? Ue8m0ToFloat(static_cast<const uint8_t*>(x_scale)[src]) : static_cast<const float*>(x_scale)[src];
      }
      sfa[i] = v;
    } else {
      sfb[i - na] = Ue8m0ToFloat(static_cast<const uint8_t*>(w_scale)[i - na]);
    }
  }
}

}  // namespace

size_t CutlassBlockwiseScratchBytes(int64_t m, int64_t h, int64_t n, int64_t k, bool w_ue8m0) {
  const int64_t g = k / kGroup, wsn = (n + kGroup - 1) / kGroup;
  return Align256(static_cast<size_t>(h * g * Ceil4(m)) * 4) + (w_ue8m0 ? Align256(static_cast<size_t>(h * wsn * g) * 4) : 0);
}

#if defined(JAX_W4A8_HAS_CUTLASS)
namespace {
using namespace cute;

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // x rows, K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // w [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // out rows, N contiguous
using TileShape = Shape<_128, _128, _128>;
// One block per cluster. H200, fifteenth session, 1 x 1 vs the former 1 x 2 (the token tile shared by TMA
// multicast), two rounds, one process per build, us: square M=4096 379 vs 383, o_proj 855 vs 843, M=16384
// square 1636 vs 1601, MLP up (8192 x 4096 x 7168) 432 vs 433, q_a 87.7 vs 91.7, kv_a 60.0 vs 63.0, V4 wo_a
// b=64 35.0 vs 39.5; identical outputs. At 1 x 2 compute-sanitizer's racecheck stops on this kernel with an
// internal error ("failed to handle a hardware exception"; memcheck and synccheck clean); at 1 x 1 racecheck
// runs and finds 0 hazards.
using ClusterShape = Shape<_1, _1, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, ElementD, LayoutD, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA, LayoutSFA>, 16, ElementB,
    cute::tuple<LayoutB, LayoutSFB>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

typename Gemm::Arguments MakeArguments(const CutlassBlockwiseParams& p, const float* sfa, const float* sfb) {
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k), l = static_cast<int>(p.h);
  const int g = k / kGroup, mp = static_cast<int>(Ceil4(p.m));
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  StrideA sa{p.h * p.k, _1{}, p.k};  // x [M, H, K]: head l's rows
  StrideB sb{p.k, _1{}, p.n * p.k};  // w [H, N, K]
  StrideD sd{p.h * p.n, _1{}, p.n};  // out [M, H, N]
  // Activation scales [H, G, ceil4(M)]: TMA loads them with M as the contiguous extent, which must be a
  // multiple of 4 floats (16 bytes), so the layout spans ceil4(M) rows (the prepared rows past M are zero).
  LayoutSFA lsfa{make_shape(make_shape(_1{}, mp), make_shape(Int<128>{}, g), l),
                 make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, mp), mp * g)};
  LayoutSFB lsfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, l));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kBatched,
                                {m, n, k, l},
                                {reinterpret_cast<const ElementA*>(p.x), sa, reinterpret_cast<const ElementB*>(p.w), sb,
                                 sfa, lsfa, sfb, lsfb},
                                {{}, nullptr, sd, reinterpret_cast<ElementD*>(p.out), sd}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  // Tiles in groups of 4 along the raster once both dimensions have many tiles (L2 reuse of both operands).
  // H200, twenty-eighth session, one process, two rounds, us, swizzle 4 vs 1 at M = 4096: square (N = K = 7168)
  // 360 / 362 vs 388 / 395, o_proj (N 7168, K 16384) 801 / 807 vs 829 / 841, q_a (N 1536) 85 / 87 vs 84 / 85
  // (kept at 1 below 2048 rows or features); raster along N instead of CUTLASS's choice 3-7% slower.
  args.scheduler.max_swizzle_size = m >= 2048 && n >= 2048 ? 4 : 1;
  int dev = 0;
  cudaGetDevice(&dev);
  args.hw_info.device_id = dev;
  args.hw_info.sm_count = CurrentSmCount();
  return args;
}

}  // namespace

bool CutlassBlockwiseBuilt() { return true; }

std::string CutlassBlockwiseUnsupported(int64_t m, int64_t h, int64_t n, int64_t k) {
  if (n % 8) return "N must be a multiple of 8 (bf16 TMA store)";
  if (k % kGroup) return "K must be a multiple of 128";
  // The problem shape and the scale layouts' strides are int32 (the tensors' own strides are int64).
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31) || h >= (int64_t{1} << 31) ||
      Ceil4(m) * (k / kGroup) >= (int64_t{1} << 31))
    return "dimensions too large for its 32-bit problem sizes";
  return {};
}

bool LaunchCutlassBlockwise(const CutlassBlockwiseParams& p, cudaStream_t stream, std::string* why) {
  if (std::string u = CutlassBlockwiseUnsupported(p.m, p.h, p.n, p.k); !u.empty()) { *why = u; return false; }
  const size_t need = CutlassBlockwiseScratchBytes(p.m, p.h, p.n, p.k, p.w_ue8m0);
  if (p.scratch_bytes < need) { *why = "scratch output too small for the CUTLASS plan"; return false; }
  const int64_t g = p.k / kGroup, mp = Ceil4(p.m), wsn = (p.n + kGroup - 1) / kGroup;
  auto* base = static_cast<uint8_t*>(p.scratch);
  float* sfa = reinterpret_cast<float*>(base);
  float* sfb = p.w_ue8m0 ? reinterpret_cast<float*>(base + Align256(static_cast<size_t>(p.h * g * mp) * 4)) : nullptr;
  const int64_t total = p.h * g * mp + (sfb ? p.h * wsn * g : 0);
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4 * int64_t{CurrentSmCount()}));
  PrepareBlockwiseScales<<<blocks, 256, 0, stream>>>(p.x_scale, p.x_ue8m0, p.w_scale, sfa, sfb, p.m, mp, p.h, g, wsn);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { *why = cudaGetErrorString(err); return false; }
  const auto args = MakeArguments(p, sfa, sfb ? sfb : static_cast<const float*>(p.w_scale));
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) { *why = "CUTLASS cannot implement these shapes"; return false; }
  if (Gemm::get_workspace_size(args) != 0) { *why = "CUTLASS asks for a workspace"; return false; }
  if (!EnsureCutlassSmemOptIn<Kernel>()) { *why = "shared-memory opt-in failed"; return false; }
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  if (const cutlass::Status status = Gemm::run(params, stream); status != cutlass::Status::kSuccess) {
    *why = std::string("CUTLASS launch failed: ") + cutlassGetStatusString(status);
    return false;
  }
  return true;
}

#else  // built without CUTLASS headers

bool CutlassBlockwiseBuilt() { return false; }
std::string CutlassBlockwiseUnsupported(int64_t, int64_t, int64_t, int64_t) {
  return "the library was built without CUTLASS (pip install nvidia-cutlass, then rebuild)";
}
bool LaunchCutlassBlockwise(const CutlassBlockwiseParams&, cudaStream_t, std::string* why) {
  *why = CutlassBlockwiseUnsupported(0, 0, 0, 0);
  return false;
}

#endif

}  // namespace jax_w4a8
