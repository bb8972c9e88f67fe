// Launch probe for the one-token loop gap (H200); not part of the library. How much a CUDA graph pays per node
// beyond its kernel, and whether programmatic dependent launch (PDL) overlaps consecutive nodes, for the node
// kinds XLA makes: a kernel node (XLA's own kernels) and a child graph holding a captured launch (a custom call
// in XLA's command buffers is traced into a graph of its own and added as a child-graph node).
//
// The kernel reads B bytes (grid-stride, 16-byte loads past L1, rotating over enough buffers that nothing comes
// from L2) with G blocks of 128 threads, optionally in clusters; its blocks stamp %globaltimer at entry (before
// griddepcontrol.wait), after the wait, and at exit. Each case runs 40 such kernels in one chain (a graph, or
// stream launches), queued behind a 2 ms spin kernel so that host submission is not timed, and prints:
//   alone    one launch on a stream between events (median of 10, us);
//   per node the chain's time / 40 (median of 10 runs, us);
//   kernel   median of the 40 kernels' spans from the first block past the wait to the last exit (us);
//   gap      median of the next kernel's first block past its wait - this kernel's last exit (us);
//   early    of the 39 pairs, how many had the next kernel's first block enter before this one's last exit
//            (PDL: it launched early, waiting in griddepcontrol.wait).
// The first line also gives %globaltimer's resolution on this machine (the smallest step seen).
// Shapes: "empty" (1 block, no bytes), kv_a (576 x 7168 e4m3 = 4.1 MB, 288 blocks in clusters of 8, as the
// decode kernel's plan), o_proj (7168 x 16384 = 117 MB, 448 blocks). Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o graph_launch_probe benchmarks/graph_launch_probe.cu && ./graph_launch_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::printf("  %s failed: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);      \
      return false;                                                                           \
    }                                                                                         \
  } while (0)

struct Stamp {
  unsigned long long entry, start, end;  // first entry, first block past the wait, last exit
};

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint4 Ld(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__global__ void Work(const uint8_t* data, int64_t bytes, Stamp* stamp, unsigned* sink) {
  if (threadIdx.x == 0) atomicMin(&stamp->entry, GlobalTimer());
  asm volatile("griddepcontrol.wait;" ::: "memory");              // at once unless launched as a dependent
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next node may launch now
  if (threadIdx.x == 0) atomicMin(&stamp->start, GlobalTimer());
  unsigned acc = 0;
  const int64_t n = bytes / 16, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = Ld(data + i * 16);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&stamp->end, GlobalTimer());
}

struct Shape {
  const char* name;
  int64_t bytes;
  int blocks, cluster;
};

constexpr int kNodes = 40;
constexpr int kReps = 10;

struct Buffers {
  std::vector<uint8_t*> data;  // rotated: their total exceeds L2
  Stamp* stamps;               // [kNodes]
  unsigned* sink;
};

cudaError_t LaunchOne(const Shape& s, const Buffers& b, int i, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(s.blocks);
  cfg.blockDim = dim3(128);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (s.cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = s.cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const uint8_t* data = b.data[i % b.data.size()];
  return cudaLaunchKernelEx(&cfg, Work, data, s.bytes, b.stamps + i, b.sink);
}

__global__ void ResetStamps(Stamp* s, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) s[i] = Stamp{~0ull, ~0ull, 0ull};
}

// Holds the stream for `ns` nanoseconds: the launches queued behind it are submitted before the timing starts.
__global__ void Spin(unsigned long long ns) {
  const unsigned long long t0 = GlobalTimer();
  while (GlobalTimer() - t0 < ns) {
  }
}

// The smallest nonzero step of %globaltimer seen in a tight loop (ns).
__global__ void TimerStep(unsigned long long* out) {
  unsigned long long best = ~0ull, prev = GlobalTimer();
  for (int i = 0; i < 100000; ++i) {
    const unsigned long long t = GlobalTimer();
    if (t != prev) best = t - prev < best ? t - prev : best;
    prev = t;
  }
  *out = best;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One launch on the stream, between events: the kernel alone (median of kReps, us).
bool Alone(const Shape& s, const Buffers& b, cudaStream_t stream, float* us) {
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> times;
  for (int r = 0; r < kReps + 2; ++r) {
    CHECK(cudaEventRecord(t0, stream));
    CHECK(LaunchOne(s, b, r, false, stream));
    CHECK(cudaEventRecord(t1, stream));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (r >= 2) times.push_back(ms * 1e3f);
  }
  *us = Median(times);
  return true;
}

// kind 0: kNodes kernel nodes captured from one stream (PDL edges if pdl); kind 1: each launch captured into a
// graph of its own, added to the chain as a child-graph node (as XLA adds a traced custom call); kind 2: plain
// stream launches, no graph.
bool Chain(const Shape& s, const Buffers& b, int kind, bool pdl, cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (kind == 0) {
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kNodes; ++i) {
      const cudaError_t e = LaunchOne(s, b, i, pdl, stream);
      if (e != cudaSuccess) {
        cudaStreamEndCapture(stream, &graph);
        std::printf("  capture failed: %s\n", cudaGetErrorString(e));
        return false;
      }
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
  } else if (kind == 1) {
    CHECK(cudaGraphCreate(&graph, 0));
    cudaGraphNode_t prev = nullptr;
    for (int i = 0; i < kNodes; ++i) {
      cudaGraph_t child = nullptr;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const cudaError_t e = LaunchOne(s, b, i, pdl, stream);
      cudaStreamEndCapture(stream, &child);
      if (e != cudaSuccess) {
        std::printf("  capture of a child graph failed: %s\n", cudaGetErrorString(e));
        return false;
      }
      cudaGraphNode_t node;
      CHECK(cudaGraphAddChildGraphNode(&node, graph, prev ? &prev : nullptr, prev ? 1 : 0, child));
      CHECK(cudaGraphDestroy(child));
      prev = node;
    }
  }
  if (graph != nullptr) CHECK(cudaGraphInstantiate(&exec, graph, 0));

  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> times;
  for (int r = 0; r < kReps + 2; ++r) {
    ResetStamps<<<1, kNodes, 0, stream>>>(b.stamps, kNodes);
    Spin<<<1, 1, 0, stream>>>(2000000ull);  // 2 ms: the launches below are queued before t0 runs
    CHECK(cudaEventRecord(t0, stream));
    if (exec != nullptr) {
      CHECK(cudaGraphLaunch(exec, stream));
    } else {
      for (int i = 0; i < kNodes; ++i) CHECK(LaunchOne(s, b, i, pdl, stream));
    }
    CHECK(cudaEventRecord(t1, stream));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (r >= 2) times.push_back(ms * 1e3f / kNodes);
  }
  std::vector<Stamp> st(kNodes);
  CHECK(cudaMemcpy(st.data(), b.stamps, sizeof(Stamp) * kNodes, cudaMemcpyDeviceToHost));
  std::vector<float> spans, gaps;
  int early = 0;
  for (int i = 0; i < kNodes; ++i) {
    spans.push_back(static_cast<float>((static_cast<double>(st[i].end) - static_cast<double>(st[i].start)) * 1e-3));
    if (i + 1 < kNodes) {
      gaps.push_back(static_cast<float>((static_cast<double>(st[i + 1].start) - static_cast<double>(st[i].end)) * 1e-3));
      early += st[i + 1].entry < st[i].end;
    }
  }
  static const char* kinds[] = {"kernel nodes", "child graphs", "stream launches"};
  std::printf("  %-15s %-4s per node %7.2f | kernel %7.2f | gap %6.2f | early %2d/%d\n", kinds[kind],
              pdl ? "PDL" : "", Median(times), Median(spans), Median(gaps), early, kNodes - 1);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  return true;
}

int main() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 1;
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  unsigned long long* step = nullptr;
  unsigned long long step_ns = 0;
  cudaMalloc(&step, sizeof(unsigned long long));
  TimerStep<<<1, 1>>>(step);
  cudaMemcpy(&step_ns, step, sizeof(step_ns), cudaMemcpyDeviceToHost);
  cudaFree(step);
  std::printf("%s, %d SMs, L2 %d MB, driver %d, runtime %d, globaltimer step %llu ns\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, driver, runtime, step_ns);
  const Shape shapes[] = {{"empty", 0, 1, 1}, {"kv_a 4.1 MB, 288 blocks, clusters of 8", 576LL * 7168, 288, 8},
                          {"o_proj 117 MB, 448 blocks", 7168LL * 16384, 448, 1}};
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 1;
  for (const Shape& s : shapes) {
    Buffers b;
    // Between two reads of a buffer at least 3x L2 of other buffers is read: nothing comes from L2.
    const int64_t per = std::max<int64_t>(s.bytes, 256);
    const int count = static_cast<int>(std::min<int64_t>(kNodes, (3LL * prop.l2CacheSize + per - 1) / per + 1));
    for (int i = 0; i < count; ++i) {
      uint8_t* p = nullptr;
      if (cudaMalloc(&p, per) != cudaSuccess) return 1;
      cudaMemset(p, i, per);
      b.data.push_back(p);
    }
    cudaMalloc(&b.stamps, sizeof(Stamp) * kNodes);
    cudaMalloc(&b.sink, sizeof(unsigned));
    cudaDeviceSynchronize();
    float alone = 0;
    if (!Alone(s, b, stream, &alone)) return 1;
    std::printf("%s (%d buffers): alone %.2f us\n", s.name, count, alone);
    for (int kind : {0, 1, 2})
      for (bool pdl : {false, true}) Chain(s, b, kind, pdl, stream);
    for (uint8_t* p : b.data) cudaFree(p);
    cudaFree(b.stamps);
    cudaFree(b.sink);
  }
  return 0;
}
