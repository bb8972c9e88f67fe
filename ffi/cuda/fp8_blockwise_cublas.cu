// ops.fp8_einsum's cuBLASLt path ("md,nd->mn", recipe (1, 128, 128), bf16 output): cuBLASLt's block-scaled FP8
// GEMM on Hopper. Same math as SPEC 4.2: e4m3 x e4m3 products summed per 128-K block in float32, each block's sum
// multiplied by its activation scale sa[m, kb] and weight scale sw[n / 128, kb], one bf16 rounding.
//
// cuBLASLt is column-major, so y [M, N] row-major is its D = op(A) op(B) of shape N x M (ld N) with A = w (K x N
// column-major = w [N, K] row-major, TRANSA = T: the "TN" form Hopper's fp8 GEMMs need), B = x (K x M, TRANSB = N).
// A's scales are BLK128x128_32F ([ceil(N/128), ceil4(G)] float32, K blocks fastest, the row stride a multiple of
// 4), B's VEC128_32F ([G, M] float32, M fastest). A small kernel writes both from the op's scales (float32 or
// UE8M0 codes, [M, G] and [ceil(N/128), G]) into the scratch, which also holds cuBLASLt's workspace.
//
// The library is not linked: the handler dlopens libcublasLt (the copy JAX's CUDA plugin loaded, found by soname
// with RTLD_NOLOAD, or a path jax_w4a8._ffi passes), so the module still loads where cuBLAS is absent. Each
// (device, shape, alignment) keeps its layouts and the heuristic's algorithm; the matmul descriptor is set per
// call (its scale pointers). Calls are serialized by a mutex (host work only: the GEMM itself is enqueued).
#include "fp8_blockwise_cublas.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "../common/checks.h"
#include "../common/formats.h"
#include "hopper_gemm.cuh"

#if defined(JAX_W4A8_HAS_CUBLASLT)
#include <cublasLt.h>
#include <dlfcn.h>
#endif

namespace jax_w4a8 {
namespace {

size_t Align256(size_t v) { return (v + 255) / 256 * 256; }
__host__ __device__ int64_t Ceil4(int64_t v) { return (v + 3) / 4 * 4; }

struct ScratchRegions {
  size_t x_scales, w_scales, workspace;  // byte offsets
};

ScratchRegions Regions(int64_t m, int64_t n, int64_t k) {
  const int64_t g = k / kGroup, wsn = (n + kGroup - 1) / kGroup;
  ScratchRegions r{};
  r.x_scales = 0;
  r.w_scales = Align256(static_cast<size_t>(g * m) * 4);
  r.workspace = r.w_scales + Align256(static_cast<size_t>(wsn * Ceil4(g)) * 4);
  return r;
}

}  // namespace

size_t CublasBlockwiseScratchBytes(int64_t m, int64_t n, int64_t k) {
  // + 256: the workspace starts at the next 256-byte boundary (cublasLtMatmul's requirement), whatever the
  // alignment of the buffer XLA hands over
  return Regions(m, n, k).workspace + 256 + kCublasWorkspaceBytes;
}

std::string CublasBlockwiseUnsupported(int64_t m, int64_t h, int64_t n, int64_t k) {
  if (h != 1) return "it runs one head (the \"md,nd->mn\" linears), got H = " + std::to_string(h);
  if (m % 4) return "M (tokens) must be a multiple of 4, got " + std::to_string(m);
  if (n % 16) return "N must be a multiple of 16, got " + std::to_string(n);
  if (k % kGroup) return "K must be a multiple of 128";
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31))
    return "dimensions too large for cuBLASLt's 32-bit sizes";
  return {};
}

#if defined(JAX_W4A8_HAS_CUBLASLT)
namespace {

// sfx [G, M] <- x_scale [M, G]; sfw [wsn, ceil4(G)] <- w_scale [wsn, G], the padding columns zero.
__global__ void PrepareCublasScales(const void* x_scale, bool x_ue8m0, const void* w_scale, bool w_ue8m0, float* sfx,
                                    float* sfw, int64_t m, int64_t g, int64_t wsn) {
  const int64_t g4 = Ceil4(g), na = g * m, nb = wsn * g4;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < na + nb; i += int64_t{gridDim.x} * blockDim.x) {
    if (i < na) {
      const int64_t row = i % m, grp = i / m, src = row * g + grp;
      sfx[i] = x_ue8m0 ? Ue8m0ToFloat(static_cast<const uint8_t*>(x_scale)[src]) : static_cast<const float*>(x_scale)[src];
    } else {
      const int64_t j = i - na, blk = j / g4, grp = j % g4, src = blk * g + grp;
      float v = 0.0f;
      if (grp < g) v = w_ue8m0 ? Ue8m0ToFloat(static_cast<const uint8_t*>(w_scale)[src]) : static_cast<const float*>(w_scale)[src];
      sfw[j] = v;
    }
  }
}

// The cuBLASLt entry points this path uses, resolved from the loaded library.
struct CublasLt {
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  size_t version = 0;
};

constexpr size_t kMinVersion = 120900;  // VEC128_32F / BLK128x128_32F arrived in cuBLAS 12.9

std::mutex g_mu;  // guards everything below
CublasLt g_lt;

template <typename F>
bool Resolve(void* lib, const char* name, F* fn, std::string* why) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *why = std::string("cuBLASLt lacks ") + name;
  return *fn != nullptr;
}

bool LoadLocked(const std::string& path, std::string* why) {
  if (g_lt.version) return true;
  void* lib = nullptr;
  if (path.empty()) {
    // The copy JAX's CUDA plugin (XLA) already loaded, then the loader's search (LD_LIBRARY_PATH, system paths).
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
      if (lib) break;
    }
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12"}) {
      if (lib) break;
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    }
  } else {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (lib == nullptr) {
    const char* err = dlerror();
    *why = std::string("cannot load cuBLASLt") + (path.empty() ? "" : " from " + path) + (err ? ": " + std::string(err) : "");
    return false;
  }
  CublasLt lt;
  if (!Resolve(lib, "cublasLtGetVersion", &lt.get_version, why) || !Resolve(lib, "cublasLtCreate", &lt.create, why) ||
      !Resolve(lib, "cublasLtMatmulDescCreate", &lt.desc_create, why) ||
      !Resolve(lib, "cublasLtMatmulDescDestroy", &lt.desc_destroy, why) ||
      !Resolve(lib, "cublasLtMatmulDescSetAttribute", &lt.desc_set, why) ||
      !Resolve(lib, "cublasLtMatrixLayoutCreate", &lt.layout_create, why) ||
      !Resolve(lib, "cublasLtMatrixLayoutDestroy", &lt.layout_destroy, why) ||
      !Resolve(lib, "cublasLtMatmulPreferenceCreate", &lt.pref_create, why) ||
      !Resolve(lib, "cublasLtMatmulPreferenceDestroy", &lt.pref_destroy, why) ||
      !Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &lt.pref_set, why) ||
      !Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &lt.heuristic, why) || !Resolve(lib, "cublasLtMatmul", &lt.matmul, why)) {
    dlclose(lib);
    return false;
  }
  lt.version = lt.get_version();
  if (lt.version < kMinVersion) {
    *why = "cuBLASLt " + std::to_string(lt.version) + " has no block-scaled FP8 GEMM (needs 12.9 or later)";
    dlclose(lib);
    return false;
  }
  g_lt = lt;  // the library stays loaded for the process's life
  return true;
}

// Per (device, M, N, K, alignments, algo): the layouts and the heuristic's algo-th result (0: its first choice).
struct Plan {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int>;  // ..., alignments, algo
std::map<PlanKey, Plan> g_plans;
std::map<int, cublasLtHandle_t> g_handles;

int Alignment(const void* p) {  // the pointer's alignment in bytes, up to 256
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

std::string Status(const char* what, cublasStatus_t s) {
  return std::string(what) + " failed (cublasStatus_t " + std::to_string(static_cast<int>(s)) + ")";
}

// Sets the descriptor's constant attributes (the scale pointers are set per call).
bool DescribeLocked(cublasLtMatmulDesc_t desc, std::string* why) {
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int32_t sa = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, sb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int8_t fast_accum = 0;  // block scaling promotes every 128-K block; fast accumulation is refused with it
  cublasStatus_t s;
  if ((s = g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum))) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sa, sizeof(sa))) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sb, sizeof(sb))) != CUBLAS_STATUS_SUCCESS) {
    *why = Status("cublasLtMatmulDescSetAttribute", s);
    return false;
  }
  return true;
}

bool PlanLocked(const PlanKey& key, int64_t m, int64_t n, int64_t k, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                Plan** out, std::string* why) {
  if (auto it = g_plans.find(key); it != g_plans.end()) {
    *out = &it->second;
    return true;
  }
  Plan p;
  auto destroy_layouts = [&p]() {
    for (cublasLtMatrixLayout_t l : {p.a, p.b, p.d})
      if (l) g_lt.layout_destroy(l);
  };
  cublasStatus_t s;
  if ((s = g_lt.layout_create(&p.a, CUDA_R_8F_E4M3, k, n, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.layout_create(&p.b, CUDA_R_8F_E4M3, k, m, k)) != CUBLAS_STATUS_SUCCESS ||
      (s = g_lt.layout_create(&p.d, CUDA_R_16BF, n, m, n)) != CUBLAS_STATUS_SUCCESS) {
    *why = Status("cublasLtMatrixLayoutCreate", s);
    destroy_layouts();
    return false;
  }
  cublasLtMatmulPreference_t pref = nullptr;
  if ((s = g_lt.pref_create(&pref)) != CUBLAS_STATUS_SUCCESS) {
    *why = Status("cublasLtMatmulPreferenceCreate", s);
    destroy_layouts();
    return false;
  }
  const uint64_t ws = kCublasWorkspaceBytes;
  const uint32_t align_a = std::get<4>(key), align_b = std::get<5>(key), align_d = std::get<6>(key);
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
  cublasLtMatmulHeuristicResult_t results[kCublasMaxAlgos] = {};
  const int algo = std::get<7>(key);
  int found = 0;
  s = g_lt.heuristic(handle, desc, p.a, p.b, p.d, p.d, pref, algo + 1, results, &found);
  g_lt.pref_destroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found <= algo || results[algo].state != CUBLAS_STATUS_SUCCESS) {
    *why = s != CUBLAS_STATUS_SUCCESS ? Status("cublasLtMatmulAlgoGetHeuristic", s)
           : found == 0 ? "cuBLASLt has no block-scaled FP8 algorithm for these shapes on this GPU"
                        : "cuBLASLt offers " + std::to_string(found) + " algorithms for these shapes; cublas_algo " +
                              std::to_string(algo) + " is past them";
    destroy_layouts();
    return false;
  }
  p.algo = results[algo].algo;
  p.workspace = results[algo].workspaceSize;
  *out = &g_plans.emplace(key, p).first->second;
  return true;
}

}  // namespace

bool CublasBlockwiseBuilt() { return true; }

size_t CublasBlockwiseLoad(const std::string& path, std::string* why) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!LoadLocked(path, why)) return 0;
  return g_lt.version;
}

bool LaunchCublasBlockwise(const CublasBlockwiseParams& p, cudaStream_t stream, std::string* why) {
  if (std::string u = CublasBlockwiseUnsupported(p.m, 1, p.n, p.k); !u.empty()) { *why = u; return false; }
  if (p.algo < 0 || p.algo >= kCublasMaxAlgos) {
    *why = "cublas_algo must be in [0, " + std::to_string(kCublasMaxAlgos) + ")";
    return false;
  }
  if (p.scratch_bytes < CublasBlockwiseScratchBytes(p.m, p.n, p.k)) {
    *why = "scratch output too small for the cuBLASLt plan";
    return false;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (!LoadLocked("", why)) return false;
  int dev = 0;
  if (cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) { *why = cudaGetErrorString(err); return false; }
  cublasLtHandle_t handle = nullptr;
  if (auto it = g_handles.find(dev); it != g_handles.end()) {
    handle = it->second;
  } else {
    if (cublasStatus_t s = g_lt.create(&handle); s != CUBLAS_STATUS_SUCCESS) { *why = Status("cublasLtCreate", s); return false; }
    g_handles[dev] = handle;
  }
  const ScratchRegions r = Regions(p.m, p.n, p.k);
  auto* base = static_cast<uint8_t*>(p.scratch);
  float* sfx = reinterpret_cast<float*>(base + r.x_scales);
  float* sfw = reinterpret_cast<float*>(base + r.w_scales);
  void* workspace = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base + r.workspace) + 255) / 256 * 256);
  if (Alignment(sfx) < 16) { *why = "scratch is not 16-byte aligned"; return false; }
  if (Alignment(p.x) < 16 || Alignment(p.w) < 16 || Alignment(p.out) < 16) {
    *why = "x, w and the output must be 16-byte aligned for cuBLASLt's FP8 GEMM";
    return false;
  }
  const int64_t g = p.k / kGroup, wsn = (p.n + kGroup - 1) / kGroup;
  const int64_t total = g * p.m + wsn * Ceil4(g);
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4 * int64_t{CurrentSmCount()}));
  PrepareCublasScales<<<blocks, 256, 0, stream>>>(p.x_scale, p.x_ue8m0, p.w_scale, p.w_ue8m0, sfx, sfw, p.m, g, wsn);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { *why = cudaGetErrorString(err); return false; }

  cublasLtMatmulDesc_t desc = nullptr;
  if (cublasStatus_t s = g_lt.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F); s != CUBLAS_STATUS_SUCCESS) {
    *why = Status("cublasLtMatmulDescCreate", s);
    return false;
  }
  bool ok = DescribeLocked(desc, why);
  const void* sfw_ptr = sfw;
  const void* sfx_ptr = sfx;
  if (ok && (g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sfw_ptr, sizeof(sfw_ptr)) != CUBLAS_STATUS_SUCCESS ||
             g_lt.desc_set(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sfx_ptr, sizeof(sfx_ptr)) != CUBLAS_STATUS_SUCCESS)) {
    *why = "cublasLtMatmulDescSetAttribute (scale pointers) failed";
    ok = false;
  }
  Plan* plan = nullptr;
  const PlanKey key{dev, p.m, p.n, p.k, Alignment(p.w), Alignment(p.x), Alignment(p.out), p.algo};
  if (ok) ok = PlanLocked(key, p.m, p.n, p.k, handle, desc, &plan, why);
  if (ok) {
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t s = g_lt.matmul(handle, desc, &alpha, p.w, plan->a, p.x, plan->b, &beta, p.out, plan->d,
                                         p.out, plan->d, &plan->algo, workspace, kCublasWorkspaceBytes, stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
      *why = Status("cublasLtMatmul", s);
      ok = false;
    }
  }
  g_lt.desc_destroy(desc);
  return ok;
}

#else  // built without cuBLASLt's header

bool CublasBlockwiseBuilt() { return false; }
size_t CublasBlockwiseLoad(const std::string&, std::string* why) {
  *why = "the library was built without cuBLASLt's header (pip install nvidia-cublas, then rebuild)";
  return 0;
}
bool LaunchCublasBlockwise(const CublasBlockwiseParams&, cudaStream_t, std::string* why) {
  CublasBlockwiseLoad("", why);
  return false;
}

#endif

}  // namespace jax_w4a8
