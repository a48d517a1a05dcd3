// Mamba2 checkpointing replay verify, one CTA per (P block, batch row, head): the "cuda" variant of
// kernels.mamba2.replay.replay_verify (launched by kernels/mamba2/replay_cuda.py, compiled there with nvcc at
// first use). The math, the history layout and the flush rule are those of replay_verify (module docstring of
// kernels/mamba2/replay.py); this file is the CUDA form of the "fma" variant's arithmetic with FlashInfer
// checkpointing_ssu's work split (include/flashinfer/mamba/kernel_checkpointing_ssu_main.cuh: one 4-warp CTA
// per head, the head's small operands staged once in shared memory). Written from the math, not copied.
//
// Per CTA (slot s = slot_ids[b] >= 0, k = clamp(PNAT[s], 0, L), r = buffer_index[s] & 1, w = 1 - r,
// flush = k + T > L, base = flush ? 0 : k, c = history dA_cumsum of buffer r):
//   h   = exp(c_{k-1}) h_s + sum_{j<k} (exp(c_{k-1} - c_j) dt'_j x_j) B_j^T          (closed-form fast-forward)
//   flush and k > 0: h_s <- round_to_nearest(h), h <- the stored value
//   y_t = exp(cum_t) (C_t . h) + sum_{j<=t} (C_t . B_j) exp(cum_t - cum_j) dt'_j x_j + D x_t
//   history buffer w, positions base..base+T-1: x (the one x buffer), B, dt', cum_t + (flush ? 0 : c_{k-1});
//   no flush: the k pending tokens' B, dt', dA_cumsum copied from buffer r to buffer w.
// PAD rows (slot < 0): zero output, no cache buffer read or written.
//
// Thread layout: 128 threads; thread tid owns state row p = p0 + tid / TPR and, of that row, the 16-byte
// chunks c = sub + TPR * i (sub = tid % TPR, i < NPT / VE; VE = 16 / sizeof(state) elements per chunk), so
// NPT = 64 state elements live in registers as fp32 and a reduction over d_state is NPT in-thread FMAs plus
// log2(TPR) shuffles. TPR = N_PAD / 64 (N_PAD = 64, 128, 256 -> 1, 2, 4 threads per row), rows per CTA
// BP = 128 / TPR. One warp-wide state load touches 32 / TPR rows x TPR * 16 contiguous bytes: whole 32-byte
// sectors, each byte of the tile read exactly once, all loads of a thread issued before the staging below.
//
// Build: nvcc -O3 -arch=sm_XX -shared -Xcompiler -fPIC -DM2R_STATE=<0|1|2> -DM2R_IN=<0|1|2> -DM2R_TPR=<1|2|4>
// [-DM2R_OUT=<0|1|2> (default M2R_IN)] [-DM2R_MAXNREG=R] (dtype codes 0 float32, 1 bfloat16, 2 float16). Exports m2r_launch (below),
// m2r_smem_bytes, m2r_abi, m2r_error_string. sm_90, Super V3 (TPR 2): 128 registers, no spills; R = 96: ~24
// bytes of spills.

// M2R_HOST_EMULATION (tests/replay_ckpt_host.cc only): the same kernel compiled by a host C++ compiler, one
// std::thread per CUDA thread, so the CPU tests run its indexing, synchronisation and history writes.
#ifndef M2R_HOST_EMULATION
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef M2R_STATE
#define M2R_STATE 0
#endif
#ifndef M2R_IN
#define M2R_IN 1
#endif
#ifndef M2R_TPR
#define M2R_TPR 2
#endif
#ifndef M2R_OUT
#define M2R_OUT M2R_IN
#endif

// Register cap: -DM2R_MAXNREG=R (the launcher's maxnreg) compiles the kernel with __maxnreg__(R); without it
// __launch_bounds__(128, 4): at most 128 registers, so 4 CTAs (16 warps) stay resident per SM whatever the
// toolkit's choice (sm_90, nvcc 13.0: 128 registers, no spills, every dtype and TPR). nvcc ignores
// -maxrregcount for a kernel with launch bounds, hence the macro.
#if defined(M2R_HOST_EMULATION)
#define M2R_BOUNDS
#elif defined(M2R_MAXNREG)
#define M2R_BOUNDS __maxnreg__(M2R_MAXNREG)
#else
#define M2R_BOUNDS __launch_bounds__(128, 4)
#endif

// Bumped whenever the launcher's argument arrays change (replay_cuda.py checks it after loading).
#define M2R_ABI 1

namespace m2r {

constexpr int kThreads = 128;
constexpr int kNPT = 64;  // state elements per thread

template <int CODE> struct DType;
template <> struct DType<0> { using T = float; };
template <> struct DType<1> { using T = __nv_bfloat16; };
template <> struct DType<2> { using T = __half; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// one element of a small (H,) / (B, T, H) tensor whose dtype is a runtime code (0 fp32, 1 bf16, 2 fp16)
__device__ __forceinline__ float load_any(const void* p, int64_t i, int code) {
  if (code == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (code == 2) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

struct Params {
  // tensors
  void* state;
  const void* x;
  const void* dt;
  const void* A;
  const void* B;
  const void* C;
  const void* D;  // nullptr: no D
  const void* dt_bias;
  const void* slot_ids;
  void* out;
  void* xh;
  void* Bh;
  float* dth;
  float* cumh;
  const int32_t* pnat;
  const int32_t* bufidx;
  // sizes
  int Bsz, T, H, P, N, G, L, slot64, dt_code, A_code, D_code, bias_code, has_limit;
  float dt_min, dt_max;
  // strides, in elements
  int64_t s_ss, s_sh, s_sp;                       // state (s_sn == 1)
  int64_t s_xb, s_xt, s_xh, s_xp;                 // x
  int64_t s_dtb, s_dtt, s_dth;                    // dt
  int64_t s_Bb, s_Bt, s_Bg, s_Bn;                 // B
  int64_t s_Cb, s_Ct, s_Cg, s_Cn;                 // C
  int64_t s_ob, s_ot, s_oh, s_op;                 // out
  int64_t s_xhs, s_xht, s_xhh, s_xhp;             // history x (one buffer)
  int64_t s_Bhs, s_Bhi, s_Bht, s_Bhg, s_Bhn;      // history B
  int64_t s_dths, s_dthi, s_dthh, s_dtht;         // history dt'
  int64_t s_chs, s_chi, s_chh, s_cht;             // history dA_cumsum
};

// Shared-memory plan (in floats; the state tile in its own dtype, rows padded by TPR x 16 bytes so that the
// 16-byte reads of one row-chunk layout are bank-conflict free) for verify width T, history length L: the
// launcher and the kernel both compute it here.
template <typename ST, int TPR> struct Smem {
  static constexpr int NP = 64 * TPR;           // padded d_state
  static constexpr int BP = kThreads / TPR;     // state rows per CTA
  static constexpr int KC = TPR == 4 ? 8 : 16;  // pending tokens staged per chunk
  static constexpr int ROW = (NP * static_cast<int>(sizeof(ST)) + TPR * 16) / 4;  // state row stride (floats)
  int S, C, BN, X, Bo, WX, CB, DT, CUM, W, total;
  __host__ __device__ Smem(int T, int L) {
    S = 0;                   // the state tile (BP rows of NP elements, dtype ST)
    C = S + BP * ROW;        // C of the new tokens (fp32)
    BN = C + T * NP;         // B of the new tokens (fp32), for C_t . B_j
    X = BN + T * NP;         // x of the new tokens, this CTA's rows
    Bo = X + T * BP;         // a chunk of pending B
    WX = Bo + KC * NP;       // a chunk of pending x (this CTA's rows; w_j is applied in the fast-forward)
    CB = WX + KC * BP;       // C_t . B_j, j <= t
    DT = CB + T * T;         // dt' of the new tokens
    CUM = DT + T;            // cum_t (within this verify)
    W = CUM + T;             // w_j = exp(c_{k-1} - c_j) dt'_j of the pending tokens
    total = W + L;
  }
};

#ifndef M2R_HOST_EMULATION
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
#endif

// Stage two lists of items into shared memory, item i of a list by thread i % kThreads: per round, U loads of
// each list (load(i) -> V) are all issued before any store(i, v), so a thread waits one memory round trip per
// round, not one per item.
template <int U, typename V1, typename V2, typename L1, typename S1, typename L2, typename S2>
__device__ __forceinline__ void stage_batched(int n1, L1 load1, S1 store1, int n2, L2 load2, S2 store2) {
  for (int i0 = static_cast<int>(threadIdx.x); i0 < max(n1, n2); i0 += U * kThreads) {
    V1 v1[U];
    V2 v2[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * kThreads < n1) v1[u] = load1(i0 + u * kThreads);
      if (i0 + u * kThreads < n2) v2[u] = load2(i0 + u * kThreads);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * kThreads < n1) store1(i0 + u * kThreads, v1[u]);
      if (i0 + u * kThreads < n2) store2(i0 + u * kThreads, v2[u]);
    }
  }
}

template <typename ST, typename IT, typename OT, int TPR>
__global__ void M2R_BOUNDS m2_replay_verify_ckpt_kernel(const Params p) {
  using SM = Smem<ST, TPR>;
  constexpr int NP = SM::NP, BP = SM::BP, KC = SM::KC, ROW = SM::ROW;
  constexpr int VE = 16 / sizeof(ST);  // state elements per 16-byte chunk
  constexpr int NCH = kNPT / VE;       // chunks per thread
#ifdef M2R_HOST_EMULATION
  float* sm = m2r_host_smem();
#else
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
#endif
  const SM lay(p.T, p.L);

  const int tid = threadIdx.x;
  const int H = p.H, T = p.T, P = p.P, N = p.N, L = p.L;
  const int npb = (P + BP - 1) / BP;
  int64_t unit = blockIdx.x;  // h fastest: consecutive CTAs share a group's B / C in L2
  const int h = static_cast<int>(unit % H);
  unit /= H;
  const int pb = static_cast<int>(unit % npb);
  const int64_t b = unit / npb;
  const int g = h / (H / p.G);
  const int p0 = pb * BP;
  const int pl = tid / TPR, sub = tid % TPR;
  const int prow = p0 + pl;
  const bool row_ok = prow < P;

  const int64_t slot = p.slot64 ? static_cast<const int64_t*>(p.slot_ids)[b]
                                : static_cast<int64_t>(static_cast<const int32_t*>(p.slot_ids)[b]);
  OT* out = static_cast<OT*>(p.out);
  float* sC = sm + lay.C;
  float* sBN = sm + lay.BN;
  float* sX = sm + lay.X;
  float* sBo = sm + lay.Bo;
  float* sWX = sm + lay.WX;
  float* sCB = sm + lay.CB;
  float* sDT = sm + lay.DT;
  float* sCUM = sm + lay.CUM;
  float* sW = sm + lay.W;
  const IT* Bin = static_cast<const IT*>(p.B);
  const IT* Cin = static_cast<const IT*>(p.C);
  const IT* xin = static_cast<const IT*>(p.x);
  const IT* Bg = Bin + b * p.s_Bb + static_cast<int64_t>(g) * p.s_Bg;  // this row's group, new tokens

  // ---- 1. the new tokens' C and B (fp32) and this CTA's rows of their x, into shared memory, with their
  // dt, dt_bias and A in registers. None depends on the slot, so these loads are in flight with the slot's;
  // each staging issues a round of loads before it stores any (`stage_batched`): the first version's loops
  // waited on one load per step, about 30 dependent memory round trips per CTA. Measured (docs/gpu/kperf_5):
  // batching them bought 1.12-1.18x only; Nsight Compute shows the kernel issue-bound instead, at about 2.9x
  // checkpointing_ssu's instruction slots (scalar FMAs where it uses tensor-core mmas;
  // docs/kernel_performance.md, "Fourth H200 run") ----
  const float A = load_any(p.A, h, p.A_code);
  float dt_new = 0.f;
  if (tid < T)
    dt_new = load_any(p.dt, b * p.s_dtb + tid * p.s_dtt + static_cast<int64_t>(h) * p.s_dth, p.dt_code) +
             load_any(p.dt_bias, h, p.bias_code);
  stage_batched<4, float2, float>(
      T * NP,
      [&](int i) {
        const int t = i / NP, n = i % NP;
        if (n >= N) return make_float2(0.f, 0.f);
        return make_float2(to_f(Cin[b * p.s_Cb + t * p.s_Ct + static_cast<int64_t>(g) * p.s_Cg + n * p.s_Cn]),
                           to_f(Bg[t * p.s_Bt + n * p.s_Bn]));
      },
      [&](int i, float2 v) {
        sC[i] = v.x;
        sBN[i] = v.y;
      },
      T * BP,
      [&](int i) {
        const int t = i / BP, q = p0 + i % BP;
        return q < P ? to_f(xin[b * p.s_xb + t * p.s_xt + static_cast<int64_t>(h) * p.s_xh + q * p.s_xp]) : 0.f;
      },
      [&](int i, float v) { sX[i] = v; });
  if (slot < 0) {  // PAD row: zero output, no cache buffer read or written (the staged inputs go unused)
    for (int i = tid; i < T * BP; i += kThreads) {
      const int t = i / BP, q = p0 + i % BP;
      if (q < P) out[b * p.s_ob + t * p.s_ot + h * p.s_oh + q * p.s_op] = from_f<OT>(0.f);
    }
    return;
  }
  const int pnat_raw = p.pnat[slot];  // in flight while the state tile's copies are issued
  const int bufidx_raw = p.bufidx[slot];

  // ---- 2. the state tile, global -> shared memory (cp.async, 16-byte chunks, each row's chunks read by
  // consecutive threads), in flight while the pending tokens are staged ----
  ST* const sbase = static_cast<ST*>(p.state) + slot * p.s_ss + static_cast<int64_t>(h) * p.s_sh;
  ST* const srow = sbase + static_cast<int64_t>(row_ok ? prow : 0) * p.s_sp;
  {
    constexpr int CPR = NP / VE;  // 16-byte chunks per padded row
    for (int q = tid; q < BP * CPR; q += kThreads) {
      const int r = q / CPR, n0 = (q % CPR) * VE;
      float* dst = sm + lay.S + r * ROW + (n0 * static_cast<int>(sizeof(ST))) / 4;
      if (p0 + r < P && n0 < N)
        cp_async16(dst, sbase + static_cast<int64_t>(p0 + r) * p.s_sp + n0);
      else
        *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  const int k = min(max(pnat_raw, 0), L);
  const int64_t rb = bufidx_raw & 1, wb = 1 - rb;
  const bool flush = k + T > L;
  const int base = flush ? 0 : k;
  const bool first_p = pb == 0;                    // one CTA per (row, head) writes dt', cumsum ...
  const bool first_h = (h % (H / p.G)) == 0;       // ... and one per (row, group) writes B
  const bool keep = !flush && first_p;             // the pending tokens stay: copy them into buffer w

  // ---- 3. the pending tokens: their weights w_j = exp(c_{k-1} - c_j) dt'_j, the first chunk of their B and
  // x; the new tokens' dt' and B history. The loads of c_{k-1} and of the first 128 tokens' c_j, dt'_j are
  // issued before the chunk's, whose stores wait for all of them at once ----
  const float* cum_r = p.cumh + slot * p.s_chs + rb * p.s_chi + static_cast<int64_t>(h) * p.s_chh;
  const float* dt_r = p.dth + slot * p.s_dths + rb * p.s_dthi + static_cast<int64_t>(h) * p.s_dthh;
  const float c_last = k > 0 ? cum_r[(k - 1) * p.s_cht] : 0.f;
  const float cj0 = tid < k ? cum_r[tid * p.s_cht] : 0.f, dtj0 = tid < k ? dt_r[tid * p.s_dtht] : 0.f;
  IT* Bh = static_cast<IT*>(p.Bh);
  const IT* xh_in = static_cast<const IT*>(p.xh);
  // pending tokens j0 .. j0 + KC - 1 (< k): B (fp32; copied raw to buffer w when they stay) and x (raw, the
  // weight w_j is applied in the fast-forward) of this CTA's rows
  auto stage_pending = [&](int j0) {
    const int kc = min(KC, k - j0);
    const auto boff = [&](int i) {
      return slot * p.s_Bhs + (j0 + i / NP) * p.s_Bht + static_cast<int64_t>(g) * p.s_Bhg + (i % NP) * p.s_Bhn;
    };
    stage_batched<4, IT, float>(
        kc * NP, [&](int i) { return i % NP < N ? Bh[boff(i) + rb * p.s_Bhi] : from_f<IT>(0.f); },
        [&](int i, IT raw) {
          sBo[i] = to_f(raw);
          if (keep && first_h && i % NP < N) Bh[boff(i) + wb * p.s_Bhi] = raw;
        },
        kc * BP,
        [&](int i) {
          const int j = i / BP, q = p0 + i % BP;
          return q < P ? to_f(xh_in[slot * p.s_xhs + (j0 + j) * p.s_xht + static_cast<int64_t>(h) * p.s_xhh +
                                    q * p.s_xhp])
                       : 0.f;
        },
        [&](int i, float v) { sWX[i] = v; });
  };
  if (k > 0) stage_pending(0);
  for (int j = tid; j < k; j += kThreads) {
    const float cj = j == tid ? cj0 : cum_r[j * p.s_cht], dtj = j == tid ? dtj0 : dt_r[j * p.s_dtht];
    sW[j] = dtj * expf(c_last - cj);
    if (keep) {
      p.dth[slot * p.s_dths + wb * p.s_dthi + static_cast<int64_t>(h) * p.s_dthh + j * p.s_dtht] = dtj;
      p.cumh[slot * p.s_chs + wb * p.s_chi + static_cast<int64_t>(h) * p.s_chh + j * p.s_cht] = cj;
    }
  }
  if (tid < T) {
    float v = dt_new;
    v = v <= 20.f ? log1pf(expf(v)) : v;  // softplus with torch's threshold of 20
    if (p.has_limit) v = fminf(fmaxf(v, p.dt_min), p.dt_max);
    sDT[tid] = v;
  }
  if (first_p && first_h) {  // the new tokens' B history (buffer w is not read by this launch): the values
    // this thread staged in step 1 (same index -> same thread), exact in IT
    for (int i = tid; i < T * NP; i += kThreads) {
      const int t = i / NP, n = i % NP;
      if (n < N)
        Bh[slot * p.s_Bhs + wb * p.s_Bhi + (base + t) * p.s_Bht + static_cast<int64_t>(g) * p.s_Bhg +
           n * p.s_Bhn] = from_f<IT>(sBN[i]);
    }
  }
  __syncthreads();

  // ---- 3. cumsum of A dt' (one thread), C_t . B_j for the T (T + 1) / 2 pairs j <= t (one warp per pair,
  // lane-strided, both operands in shared memory: the first version read B from global memory here, up to
  // 4 pairs x N / 32 dependent L2 round trips per warp on the CTA's critical path) ----
  if (tid == 0) {
    float acc = 0.f;
    for (int t = 0; t < T; ++t) {
      acc += A * sDT[t];
      sCUM[t] = acc;
    }
  }
  {
    const int warp = tid / 32, lane = tid % 32;
    for (int q = warp; q < T * (T + 1) / 2; q += kThreads / 32) {
      int t = 0;  // q -> (t, j), j <= t, row-major over the lower triangle
      while ((t + 1) * (t + 2) / 2 <= q) ++t;
      const int j = q - t * (t + 1) / 2;
      float acc = 0.f;
      for (int n = lane; n < N; n += 32) acc += sC[t * NP + n] * sBN[j * NP + n];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) sCB[t * T + j] = acc;
    }
  }

  // ---- 4. fast-forward by the k pending tokens, in chunks of KC staged tokens ----
  cp_async_wait_all();
  __syncthreads();  // the state tile has landed (every thread waited for its own copies)
  float hs[kNPT];
  const float* srow_sm = sm + lay.S + pl * ROW;
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const uint4 raw = *reinterpret_cast<const uint4*>(srow_sm + ((sub + TPR * i) * VE * static_cast<int>(sizeof(ST))) / 4);
    const ST* v = reinterpret_cast<const ST*>(&raw);
#pragma unroll
    for (int e = 0; e < VE; ++e) hs[i * VE + e] = to_f(v[e]);
  }
  const float decay = expf(c_last);
#pragma unroll
  for (int e = 0; e < kNPT; ++e) hs[e] *= decay;
  for (int j0 = 0; j0 < k; j0 += KC) {
    const int kc = min(KC, k - j0);
    if (j0 > 0) {  // later chunks (k > KC): staged here; the first one was staged with the small operands
      __syncthreads();  // the previous chunk's readers are done
      stage_pending(j0);
      __syncthreads();
    }
    for (int j = 0; j < kc; ++j) {
      const float wx = sW[j0 + j] * sWX[j * BP + pl];  // (w_j x_j), then times B_j: the "fma" order
      const float* bo = sBo + j * NP;
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        const int n0 = (sub + TPR * i) * VE;
#pragma unroll
        for (int e = 0; e < VE; e += 4) {
          const float4 bv = *reinterpret_cast<const float4*>(bo + n0 + e);
          hs[i * VE + e + 0] += wx * bv.x;
          hs[i * VE + e + 1] += wx * bv.y;
          hs[i * VE + e + 2] += wx * bv.z;
          hs[i * VE + e + 3] += wx * bv.w;
        }
      }
    }
  }

  // ---- 5. flush: store the state (round to nearest), continue from the stored value ----
  if (flush && k > 0 && row_ok) {
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int n0 = (sub + TPR * i) * VE;
      uint4 packed;
      ST* v = reinterpret_cast<ST*>(&packed);
#pragma unroll
      for (int e = 0; e < VE; ++e) {
        v[e] = from_f<ST>(hs[i * VE + e]);
        hs[i * VE + e] = to_f(v[e]);
      }
      if (n0 < N) *reinterpret_cast<uint4*>(srow + n0) = packed;
    }
  }
  __syncthreads();  // sCUM, sCB complete; every read of the pending x history done (x is written below)

  // ---- 6. outputs: y_t = exp(cum_t) (C_t . h) + sum_{j<=t} M_tj x_j + D x_t ----
  const float Dh = p.D ? load_any(p.D, h, p.D_code) : 0.f;
  for (int t = 0; t < T; ++t) {
    const float* ct = sC + t * NP;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int n0 = (sub + TPR * i) * VE;
#pragma unroll
      for (int e = 0; e < VE; e += 4) {
        const float4 cv = *reinterpret_cast<const float4*>(ct + n0 + e);
        acc += hs[i * VE + e + 0] * cv.x;
        acc += hs[i * VE + e + 1] * cv.y;
        acc += hs[i * VE + e + 2] * cv.z;
        acc += hs[i * VE + e + 3] * cv.w;
      }
    }
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (sub == t % TPR && row_ok) {
      const float ct_cum = sCUM[t];
      float intra = 0.f;
      for (int j = 0; j <= t; ++j)
        intra += sCB[t * T + j] * expf(ct_cum - sCUM[j]) * sDT[j] * sX[j * BP + pl];
      float y = expf(ct_cum) * acc + intra;
      if (p.D) y += Dh * sX[t * BP + pl];
      out[b * p.s_ob + t * p.s_ot + static_cast<int64_t>(h) * p.s_oh + static_cast<int64_t>(prow) * p.s_op] =
          from_f<OT>(y);
    }
  }

  // ---- 7. the new tokens become history: x (this CTA's rows), dt' and cumsum (first P block) ----
  IT* xh = static_cast<IT*>(p.xh);
  for (int i = tid; i < T * BP; i += kThreads) {
    const int t = i / BP, q = p0 + i % BP;
    if (q < P)
      xh[slot * p.s_xhs + (base + t) * p.s_xht + static_cast<int64_t>(h) * p.s_xhh + q * p.s_xhp] =
          from_f<IT>(sX[i]);
  }
  if (first_p && tid < T) {
    const float cum_base = flush ? 0.f : c_last;
    const int64_t pos = base + tid;
    p.dth[slot * p.s_dths + wb * p.s_dthi + static_cast<int64_t>(h) * p.s_dthh + pos * p.s_dtht] = sDT[tid];
    p.cumh[slot * p.s_chs + wb * p.s_chi + static_cast<int64_t>(h) * p.s_chh + pos * p.s_cht] = sCUM[tid] + cum_base;
  }
}

}  // namespace m2r

using namespace m2r;
// The kernel's Params from the launcher's argument arrays (layout: m2r_launch below).
inline Params m2r_params(void* const* ptrs, const long long* ints, const float* floats) {
  Params p;
  p.state = ptrs[0];
  p.x = ptrs[1];
  p.dt = ptrs[2];
  p.A = ptrs[3];
  p.B = ptrs[4];
  p.C = ptrs[5];
  p.D = ptrs[6];
  p.dt_bias = ptrs[7];
  p.slot_ids = ptrs[8];
  p.out = ptrs[9];
  p.xh = ptrs[10];
  p.Bh = ptrs[11];
  p.dth = static_cast<float*>(ptrs[12]);
  p.cumh = static_cast<float*>(ptrs[13]);
  p.pnat = static_cast<const int32_t*>(ptrs[14]);
  p.bufidx = static_cast<const int32_t*>(ptrs[15]);
  int q = 0;
  p.Bsz = static_cast<int>(ints[q++]);
  p.T = static_cast<int>(ints[q++]);
  p.H = static_cast<int>(ints[q++]);
  p.P = static_cast<int>(ints[q++]);
  p.N = static_cast<int>(ints[q++]);
  p.G = static_cast<int>(ints[q++]);
  p.L = static_cast<int>(ints[q++]);
  p.slot64 = static_cast<int>(ints[q++]);
  p.dt_code = static_cast<int>(ints[q++]);
  p.A_code = static_cast<int>(ints[q++]);
  p.D_code = static_cast<int>(ints[q++]);
  p.bias_code = static_cast<int>(ints[q++]);
  p.has_limit = static_cast<int>(ints[q++]);
  int64_t* strides[] = {&p.s_ss, &p.s_sh, &p.s_sp, &p.s_xb, &p.s_xt, &p.s_xh, &p.s_xp, &p.s_dtb, &p.s_dtt,
                        &p.s_dth, &p.s_Bb, &p.s_Bt, &p.s_Bg, &p.s_Bn, &p.s_Cb, &p.s_Ct, &p.s_Cg, &p.s_Cn,
                        &p.s_ob, &p.s_ot, &p.s_oh, &p.s_op, &p.s_xhs, &p.s_xht, &p.s_xhh, &p.s_xhp,
                        &p.s_Bhs, &p.s_Bhi, &p.s_Bht, &p.s_Bhg, &p.s_Bhn, &p.s_dths, &p.s_dthi, &p.s_dthh,
                        &p.s_dtht, &p.s_chs, &p.s_chi, &p.s_chh, &p.s_cht};
  for (int64_t* s : strides) *s = ints[q++];
  p.dt_min = floats[0];
  p.dt_max = floats[1];
  return p;
}

using StateT = DType<M2R_STATE>::T;
using InT = DType<M2R_IN>::T;
using OutT = DType<M2R_OUT>::T;

extern "C" {

__attribute__((visibility("default"))) int m2r_abi() { return M2R_ABI; }

// Dynamic shared memory of one CTA (bytes) for verify width T and history length L.
__attribute__((visibility("default"))) long long m2r_smem_bytes(int T, int L) {
  return static_cast<long long>(Smem<StateT, M2R_TPR>(T, L).total) * 4;
}

#ifndef M2R_HOST_EMULATION
// Launch on `stream` (a cudaStream_t; the caller's current stream, so CUDA-graph capture records it).
// ptrs (16): state, x, dt, A, B, C, D (0 = none), dt_bias, slot_ids, out, history x, B, dt, dA_cumsum,
//   prev_num_accepted, buffer_index.
// ints (13 + 39): Bsz, T, H, P, N, G, L, slot ids int64 (0/1), dtype codes of dt, A, D, dt_bias (0 fp32,
//   1 bf16, 2 fp16), has time-step limit (0/1); then the strides (elements) in the order of Params.
// floats (2): dt_min, dt_max.
// Returns 0, or a cudaError_t code (cudaGetErrorString names it via m2r_error_string).
__attribute__((visibility("default"))) int m2r_launch(void* const* ptrs, const long long* ints,
                                                      const float* floats, void* stream) {
  const Params p = m2r_params(ptrs, ints, floats);
  if (p.Bsz <= 0) return 0;
  constexpr int BP = Smem<StateT, M2R_TPR>::BP;
  const long long blocks = static_cast<long long>(p.Bsz) * p.H * ((p.P + BP - 1) / BP);
  const size_t smem = static_cast<size_t>(Smem<StateT, M2R_TPR>(p.T, p.L).total) * 4;
  auto* kernel = m2_replay_verify_ckpt_kernel<StateT, InT, OutT, M2R_TPR>;
  if (smem > 48 * 1024) {
    // Above the default dynamic limit: opt in once per device and size (a function attribute, not a stream
    // operation; the first launch, eager, sets it before any CUDA-graph capture).
    static int granted[64] = {0};
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (dev < 0 || dev >= 64 || granted[dev] < static_cast<int>(smem)) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return static_cast<int>(e);
      if (dev >= 0 && dev < 64) granted[dev] = static_cast<int>(smem);
    }
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

__attribute__((visibility("default"))) const char* m2r_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
#endif  // M2R_HOST_EMULATION

}  // extern "C"
