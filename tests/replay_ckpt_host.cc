// Host emulation of kernels/mamba2/replay_ckpt.cu for the CPU tests (tests/test_replay_cuda.py): the kernel's
// own source compiled by g++ with M2R_HOST_EMULATION, each CTA run as 128 std::threads that meet at
// __syncthreads (a std::barrier of the CTA) and exchange shuffles through a per-warp buffer and barrier, the
// CTAs one after another. It checks the kernel's indexing, shared-memory plan, synchronisation, flush and
// history writes against the PyTorch reference on the CPU; not its speed, nor races between CTAs (the GPU
// tests run it for real).
//
// Build: g++ -std=c++20 -O1 -shared -fPIC -pthread -I<cuda>/include -I kernels/mamba2 -DM2R_STATE=..
//        -DM2R_IN=.. [-DM2R_OUT=..] -DM2R_TPR=.. tests/replay_ckpt_host.cc -o LIB.so
// Exports (beside the .cu's m2r_abi and m2r_smem_bytes): m2r_host_launch(ptrs, ints, floats), the argument
// arrays of m2r_launch.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <vector_functions.h>
#include <vector_types.h>

#define M2R_HOST_EMULATION 1
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

using std::max;
using std::min;

struct HostDim3 {
  unsigned x = 0;
};

struct HostWarp {
  float buf[32];
  std::barrier<> bar{32};
};

struct HostCta {
  std::barrier<> bar{128};
  HostWarp warps[4];
  std::vector<float4> smem;
};

thread_local HostDim3 threadIdx, blockIdx;
thread_local HostCta* host_cta = nullptr;

inline void __syncthreads() { host_cta->bar.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  HostWarp& w = host_cta->warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  w.buf[lane] = v;
  w.bar.arrive_and_wait();
  const float r = w.buf[lane ^ lane_mask];
  w.bar.arrive_and_wait();
  return r;
}

inline float* m2r_host_smem() { return reinterpret_cast<float*>(host_cta->smem.data()); }

// cp.async: a plain 16-byte copy (the wait is then a no-op)
inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async_wait_all() {}

#include "replay_ckpt.cu"

extern "C" __attribute__((visibility("default"))) int m2r_host_launch(void* const* ptrs, const long long* ints,
                                                                      const float* floats) {
  const Params p = m2r_params(ptrs, ints, floats);
  if (p.Bsz <= 0) return 0;
  constexpr int BP = Smem<StateT, M2R_TPR>::BP;
  const long long blocks = static_cast<long long>(p.Bsz) * p.H * ((p.P + BP - 1) / BP);
  const size_t smem = static_cast<size_t>(Smem<StateT, M2R_TPR>(p.T, p.L).total) * 4;
  for (long long blk = 0; blk < blocks; ++blk) {
    auto cta = std::make_unique<HostCta>();
    // poisoned like uninitialised shared memory: a read of a slot nobody wrote shows as NaN
    cta->smem.assign((smem + 15) / 16, make_float4(NAN, NAN, NAN, NAN));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < 128; ++t) {
      threads.emplace_back([&, t] {
        threadIdx.x = t;
        blockIdx.x = static_cast<unsigned>(blk);
        host_cta = cta.get();
        m2_replay_verify_ckpt_kernel<StateT, InT, OutT, M2R_TPR>(p);
      });
    }
    for (auto& th : threads) th.join();
  }
  return 0;
}
