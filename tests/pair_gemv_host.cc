// Host emulation of kernels/quant/pair_gemv.cu for the CPU tests (tests/test_pair_cuda.py): the kernel's own
// source compiled by g++ with NVP_HOST_EMULATION, each CTA run as 128 std::threads that meet at __syncthreads
// (a std::barrier of the CTA); each warp's mma.sync is emulated by gathering the 32 lanes' fragments through a
// per-warp buffer (the PTX ISA's m16n8k16 fragment layout), multiplying in fp32 in column order, and handing
// each lane its part of D. The CTAs run one after another. It checks the kernel's indexing, decode, fragment
// mapping and epilogue against the PyTorch reference on the CPU; not its speed, nor the tensor core's own
// summation order (the GPU tests run it for real).
//
// Build: g++ -std=c++20 -O1 -shared -fPIC -pthread -I kernels/quant tests/pair_gemv_host.cc -o LIB.so
// Exports (beside the .cu's nvp_abi): nvp_host_launch(ptrs, ints) and nvp_host_launch_grouped(ptrs, ints),
// the argument arrays of nvp_launch and nvp_launch_grouped.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define NVP_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__

struct HostDim3 {
  unsigned x = 0, y = 0;
};

struct HostWarp {
  uint32_t a[32][4];
  uint32_t b[32][2];
  float c[32][4];
  float d[32][4];
  std::barrier<> bar{32};
};

struct HostCta {
  std::barrier<> bar{128};
  HostWarp warps[4];
  float smem[4 * 8 * 4 * 16];  // the larger of the two kernels' plans (the grouped one's)
};

thread_local HostDim3 threadIdx, blockIdx, gridDim;
thread_local HostCta* host_cta = nullptr;

inline void __syncthreads() { host_cta->bar.arrive_and_wait(); }
inline float* nvp_host_smem() { return host_cta->smem; }

static inline float bf16_lo(uint32_t v) {
  const uint32_t u = v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float bf16_hi(uint32_t v) { return bf16_lo(v >> 16); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += A B, over one warp. Lane (g = lane / 4, t = lane % 4):
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9] (low half first);
// b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
inline void nvp_host_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  HostWarp& w = host_cta->warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) {
    w.a[lane][i] = a[i];
    w.c[lane][i] = d[i];
  }
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar.arrive_and_wait();
  if (lane == 0) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const uint32_t* al = w.a[l];
      A[g][2 * t] = bf16_lo(al[0]);
      A[g][2 * t + 1] = bf16_hi(al[0]);
      A[g + 8][2 * t] = bf16_lo(al[1]);
      A[g + 8][2 * t + 1] = bf16_hi(al[1]);
      A[g][2 * t + 8] = bf16_lo(al[2]);
      A[g][2 * t + 9] = bf16_hi(al[2]);
      A[g + 8][2 * t + 8] = bf16_lo(al[3]);
      A[g + 8][2 * t + 9] = bf16_hi(al[3]);
      B[2 * t][g] = bf16_lo(w.b[l][0]);
      B[2 * t + 1][g] = bf16_hi(w.b[l][0]);
      B[2 * t + 8][g] = bf16_lo(w.b[l][1]);
      B[2 * t + 9][g] = bf16_hi(w.b[l][1]);
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
      for (int i = 0; i < 4; ++i) {
        float s = w.c[l][i];
        for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
        w.d[l][i] = s;
      }
    }
  }
  w.bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = w.d[lane][i];
  w.bar.arrive_and_wait();  // lane 0 may not overwrite d before every lane has read it
}

// Memory accesses of the kernel while recording is on (nvp_host_record): the address of every global load
// (pair_gemv.cu's ld16 / ld2 / ldf, kind 0) and every L2 prefetch (prefetch_l2, kind 1), for the tests to
// compare.
#include <mutex>
static std::mutex host_records_mutex;
static bool host_recording = false;
static std::vector<long long> host_records[2];

inline void nvp_host_access(int kind, const void* p) {
  std::lock_guard<std::mutex> lock(host_records_mutex);
  if (host_recording) host_records[kind].push_back(static_cast<long long>(reinterpret_cast<uintptr_t>(p)));
}
inline void nvp_host_load(const void* p) { nvp_host_access(0, p); }
inline void nvp_host_prefetch(const void* p) { nvp_host_access(1, p); }

#include "pair_gemv.cu"

// Run `kernel` over `grid` (nvp::dispatch's), one CTA after another, each as kThreads std::threads.
template <class Kernel>
static void run_grid(const nvp::Params& p, nvp::Grid grid, Kernel kernel) {
  for (long long y = 0; y < grid.y; ++y) {
    for (long long bx = 0; bx < grid.x; ++bx) {
      auto cta = std::make_unique<HostCta>();
      for (float& v : cta->smem) v = NAN;  // a read of a slot nobody wrote shows as NaN
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < nvp::kThreads; ++t) {
        threads.emplace_back([&, t] {
          threadIdx.x = t;
          blockIdx.x = static_cast<unsigned>(bx);
          blockIdx.y = static_cast<unsigned>(y);
          gridDim.x = static_cast<unsigned>(grid.x);
          gridDim.y = static_cast<unsigned>(grid.y);
          host_cta = cta.get();
          kernel(p);
        });
      }
      for (auto& th : threads) th.join();
    }
  }
}

// Recording on (and both lists cleared) or off.
extern "C" __attribute__((visibility("default"))) void nvp_host_record(int on) {
  std::lock_guard<std::mutex> lock(host_records_mutex);
  host_recording = on != 0;
  if (on) host_records[0].clear(), host_records[1].clear();
}

// The number of recorded addresses of `kind` (0 loads, 1 prefetches); with out non-null, also copied there.
extern "C" __attribute__((visibility("default"))) long long nvp_host_records(int kind, long long* out) {
  std::lock_guard<std::mutex> lock(host_records_mutex);
  if (out) std::copy(host_records[kind].begin(), host_records[kind].end(), out);
  return static_cast<long long>(host_records[kind].size());
}

// nvp_launch / nvp_launch_grouped on the host: the same nvp::dispatch; 1 (cudaErrorInvalidValue's place) where
// it has no kernel.
extern "C" __attribute__((visibility("default"))) int nvp_host_launch(void* const* ptrs, const long long* ints) {
  const nvp::Params p = nvp::params_of(ptrs, ints);
  if (p.P <= 0 || p.NOUT <= 0) return 0;
  return nvp::dispatch(p, false, [&](auto kernel, nvp::Grid grid) { run_grid(p, grid, kernel); }) ? 0 : 1;
}

extern "C" __attribute__((visibility("default"))) int nvp_host_launch_grouped(void* const* ptrs,
                                                                              const long long* ints) {
  const nvp::Params p = nvp::params_of(ptrs, ints);
  if (p.P <= 0 || p.NOUT <= 0 || p.E <= 0) return 0;
  return nvp::dispatch(p, true, [&](auto kernel, nvp::Grid grid) { run_grid(p, grid, kernel); }) ? 0 : 1;
}
