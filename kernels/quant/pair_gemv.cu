// Routed experts at decode sizes with quantized weights, one projection of the per-pair scheme
// (kernels/quant/moe_gemv.py) as a CUDA kernel: the "cuda" per-pair kernel of kernels.quant.nvfp4.moe_gemv_nvfp4
// and of kernels.quant.block_fp8.moe_gemv_block_fp8's w8a16 scheme (launched by kernels/quant/pair_cuda.py,
// compiled there with nvcc at first use). Weight-only (W4A16 / W8A16): the codes are decoded in the registers
// that feed a bf16 tensor-core MMA; the dequantized weight never exists in memory.
//
// Per CTA: one (token, expert) pair p and 16 output rows n0..n0+15 (the MMA's M); its 4 warps split the input
// columns in 128-column chunks, warp w taking chunks w, w + 4, ... (two chunks' loads in flight per step). Per
// chunk, lane (g = lane / 4, t = lane % 4) loads its 32 columns (c0 = 128 chunk + 32 t .. c0 + 31) of codes of
// rows n0 + g and n0 + g + 8 (NVFP4: 16 bytes a row; FP8: 32), their scales, and the same 32 columns of x; 8
// mma.sync.m16n8k16 then consume them.
//
// Why the natural layout needs no weight re-layout: in m16n8k16 the lane (g, t) holds A's columns {2t, 2t+1, 2t+8, 2t+9} of
// rows g and g + 8 and B's same four rows; a dot product does not care which physical column a logical one
// stands for as long as A and B agree, and both sides of that agreement live in lanes with the same t. So
// each lane maps its logical columns onto the 32 physical ones it loaded, and permutes x's registers to match
// (byte permutes).
// - NVFP4: the MMA pair (2q, 2q + 1) of word q (8 codes, elements e0..e7 at bits 4i..4i+3) takes the element
//   pairs (e0, e4), (e1, e5) and (e2, e6), (e3, e7) as its bf16x2 registers. Decode of a pair (the same shifts
//   for both halves): the magnitude bits to bf16 bits 6-8 (exponent 0-3 and mantissa MSB), the sign to bit 15,
//   which reads as e2m1 * 2^-126 (code 0.5 a bf16 subnormal), about four integer operations per two weights;
//   then one bf16x2 multiply by the block scale times 2^118, exact since e2m1 * e4m3 has at most 2 + 4
//   significant bits and the product, e2m1 * scale * 2^-8, lies in [2^-18, 10.5]; weight_scale_2 times 2^8
//   multiplies the sum.
// - Block FP8: MMA j takes word j (4 codes, bytes b0..b3) as the pairs (b0, b2), (b1, b3), each decoded to
//   e4m3 * 2^-120 by four integer operations (subnormals exact) and multiplied by 2^120 (exact); each chunk
//   is one 128 x 128 scale block, so its MMAs go into zeroed accumulators scaled once by weight_scale_inv.
// B = x (bf16) in every column of the MMA's N = 8 (the 7 extra columns cost no instruction), fp32
// accumulators.
//
// The warps' sums meet in shared memory and are added in warp order (a fixed order: the same bits eager and
// in a CUDA graph); the epilogue rounds as kernels/moe_gemv.py's store_pair_rows (sum rounded to bf16, the
// activation rounded, a gated pair times its rounded up projection). A NaN block scale gives NaN rows, as the
// references; an FP8 weight code that is NaN (0x7F / 0xFF, which no quantizer writes) reads as a finite value.
//
// Scope (kernels/quant/pair_cuda.py checks it): bf16 x and out, K % 32 == 0, codes 16-byte aligned (rows
// and experts), scales 2-byte (NVFP4) / 4-byte (FP8, contiguous blocks) aligned, x rows 16-byte aligned,
// P <= 65535 pairs, sm_80 or newer. Source of the decode idea: Marlin (Frantar et al., "MARLIN: Mixed-Precision
// Auto-Regressive Parallel Inference on Large Language Models", PPoPP 2025; the FP4 / FP8 dequantization of
// vLLM's csrc/quantization/marlin), written here from the bit layouts, without Marlin's weight repacking; the
// repacked formats (Nvfp4Repacked, BlockFp8Repacked below) move bits inside each word at load time for a
// cheaper decode.
//
// The other kernels here (each with its comment below): the grouped forms, which take the rows sorted by
// expert and each expert's rows as the MMA's N (grouped_gemv_kernel, grouped_wide_kernel,
// grouped_pipelined_kernel), and the persistent forms (persistent_kernel), a grid sized to the GPU whose warps
// walk the tiles with the next tile's codes in flight, grouped or per pair. nvp::dispatch maps each launch to
// one of them.
//
// Build: nvcc -O3 -arch=sm_XX -shared -Xcompiler -fPIC -std=c++17. Exports nvp_abi, nvp_launch,
// nvp_error_string. NVP_HOST_EMULATION (tests/pair_gemv_host.cc only): the same kernel compiled by a host C++
// compiler, one std::thread per CUDA thread, the MMA emulated over the warp.

#ifndef NVP_HOST_EMULATION
#include <atomic>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>
#include <string.h>

// Bumped whenever the launcher's argument arrays change (pair_cuda.py checks it after loading).
#define NVP_ABI 9

#if defined(NVP_HOST_EMULATION)
#define NVP_BOUNDS
#define NVP_BOUNDS_OCC(n)
#else
#define NVP_BOUNDS __launch_bounds__(128)
#define NVP_BOUNDS_OCC(n) __launch_bounds__(128, n)
#endif

namespace nvp {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16;    // output rows per CTA: the MMA's M
constexpr int kChunk = 128;  // input columns per warp step: 4 lanes x 32

struct Params {
  const uint16_t* x;    // [rows, K] bf16 bits
  const int64_t* idx;   // [P] expert of each pair (grouped form: int32 [E] cumulative row ends, read as such)
  const uint8_t* w;     // codes (gate when gated, else up / down): NVFP4 [E, NOUT, K / 2], FP8 [E, NOUT, K]
  const uint8_t* s;     // scales: NVFP4 e4m3 [E, NOUT, K / 16], FP8 float32 [E, NOUT / 128, K / 128]
  const float* g;       // NVFP4 [E] weight_scale_2 (FP8: unused)
  const uint8_t* w2;    // up when gated (else unused)
  const uint8_t* s2;
  const float* g2;
  uint16_t* out;        // [P, NOUT] bf16 bits
  int64_t P, NOUT, K, TOPK, act, gated;
  int64_t sxm, swe, swn, sse, ssn, som;  // strides: x rows, out rows (elements); codes, scales (bytes)
  int64_t fmt;                           // kFmt*: 0 NVFP4, 1 block FP8, 2 / 3 their repacked forms
  int64_t E;                             // experts (the grouped form's grid)
  int64_t prefetch;                      // per pair: 1 = the CTA's weights into L2 up front; m32: rolling
  int64_t pdl;                           // launch as a programmatic dependent of the previous kernel (host only)
  int64_t form;     // 0 split K, 1 wide, 2 pipelined, 3 persistent, 4 m32 (pair_cuda.GROUPED_FORMS; per pair 0, 3)
  int64_t xperm;    // pipelined NVFP4 only: x's columns stored permuted (pair_cuda.X_PERM)
  int64_t ctas;     // persistent forms only: the grid's CTAs (0: persistent_grid's default)
  int64_t sms;      // the device's SMs (not an argument: the device launchers fill it; 0 in the host harness)
};

__device__ inline float as_f32(uint32_t u) {
#ifdef NVP_HOST_EMULATION
  float f;
  memcpy(&f, &u, 4);
  return f;
#else
  return __uint_as_float(u);
#endif
}

__device__ inline uint32_t as_u32(float f) {
#ifdef NVP_HOST_EMULATION
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#else
  return __float_as_uint(f);
#endif
}

// fp32 -> bf16 bits, round to nearest even (torch's cast); a NaN stays a (quiet) NaN.
__device__ inline uint32_t bf16_rn(float f) {
  const uint32_t u = as_u32(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ inline float bf16_f32(uint32_t b) { return as_f32(b << 16); }

// Elements i and i + 4 of a word of 8 codes (bits 4i..4i+3 and 4i+16..4i+19) as a bf16x2 of e2m1 * 2^-126:
// magnitude bits to 6-8 / 22-24, sign to 15 / 31 (one shift each, the same for both halves).
template <int I>
__device__ inline uint32_t e2m1_pair(uint32_t v) {
  constexpr int MS = 6 - 4 * I, SS = 12 - 4 * I;
  uint32_t mag;
  if constexpr (MS >= 0)
    mag = v << MS;
  else
    mag = v >> -MS;
  return (mag & 0x01C001C0u) | ((v << SS) & 0x80008000u);
}

// The two e4m3 block scales of a 16-bit word (bytes b0, b1) times 2^118, each as a bf16x2 holding it twice
// (lo: b0, hi: b1): exact (448 * 2^118 < 2^127, the smallest subnormal 2^-9 times 2^118 normal), e4m3's NaN
// (0x7F / 0xFF) stays NaN. On the GPU one cvt of both bytes to f16x2, two converts to fp32 and two multiplies;
// a bf16 is then the fp32's high half (exact), put in both halves by one byte permute each.
__device__ inline void scale_pairs(uint32_t b, uint32_t& lo, uint32_t& hi) {
#ifdef NVP_HOST_EMULATION
  float f[2];
  for (int i = 0; i < 2; ++i) {
    const uint32_t c = (b >> (8 * i)) & 0xFFu;  // the byte's bits in an fp32 read as scale * 2^-120
    f[i] = as_f32(((c & 0x80u) << 24) | ((c & 0x7Fu) << 20)) * 0x1p119f * 0x1p119f;
    if ((c & 0x7Fu) == 0x7Fu) f[i] = as_f32(0x7FC00000u);
  }
  lo = (as_u32(f[0]) >> 16) * 0x10001u;
  hi = (as_u32(f[1]) >> 16) * 0x10001u;
#else
  const __half2_raw h2r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(b), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2r));
  lo = __byte_perm(__float_as_uint(f.x * 0x1p118f), 0u, 0x3232);
  hi = __byte_perm(__float_as_uint(f.y * 0x1p118f), 0u, 0x3232);
#endif
}

// bf16x2 product (each half rounded to nearest; exact here).
__device__ inline uint32_t hmul2(uint32_t a, uint32_t b) {
#ifdef NVP_HOST_EMULATION
  const uint32_t lo = bf16_rn(bf16_f32(a & 0xFFFFu) * bf16_f32(b & 0xFFFFu));
  const uint32_t hi = bf16_rn(bf16_f32(a >> 16) * bf16_f32(b >> 16));
  return lo | (hi << 16);
#elif __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  // sm_80 - sm_89 have no bf16x2 multiply: a * b + (-0.0), the same rounding (and the same exact products)
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
#endif
}

// Byte permute (PRMT): bytes of {hi:lo} picked by the selector's nibbles.
__device__ inline uint32_t prmt(uint32_t lo, uint32_t hi, uint32_t sel) {
#ifdef NVP_HOST_EMULATION
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#else
  return __byte_perm(lo, hi, sel);
#endif
}

// d += A (16 x 16 bf16, row) * B (16 x 8 bf16, col), fp32: mma.sync.aligned.m16n8k16 (sm_80+).
__device__ inline void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef NVP_HOST_EMULATION
  nvp_host_mma(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

struct U4 {
  uint32_t v[4];
};

__device__ inline U4 ld16(const void* p) {
  U4 r;
#ifdef NVP_HOST_EMULATION
  nvp_host_load(p);
  memcpy(r.v, p, 16);
#else
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
  r.v[0] = q.x;
  r.v[1] = q.y;
  r.v[2] = q.z;
  r.v[3] = q.w;
#endif
  return r;
}

__device__ inline float ldf(const uint8_t* p) {
#ifdef NVP_HOST_EMULATION
  nvp_host_load(p);
  float v;
  memcpy(&v, p, 4);
  return v;
#else
  return __ldg(reinterpret_cast<const float*>(p));
#endif
}

__device__ inline uint32_t ld2(const uint8_t* p) {
#ifdef NVP_HOST_EMULATION
  nvp_host_load(p);
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
#else
  return __ldg(reinterpret_cast<const unsigned short*>(p));
#endif
}

// Programmatic dependent launch (PTX griddepcontrol, sm_90+; no-ops on older GPUs and in host emulation).
// launch_dependents lets the next kernel on the stream, when it was launched with the programmatic-
// serialization attribute, start once every CTA of this grid has executed it; wait blocks until the previous
// kernel has completed and its writes are visible (at once when this launch did not ask for PDL). It may be
// called more than once.
__device__ inline void pdl_launch_dependents() {
#if !defined(NVP_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ inline void pdl_wait() {
#if !defined(NVP_HOST_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Ask the memory system to bring the line holding p into L2 (no register, no wait: PTX prefetch.global.L2).
__device__ inline void prefetch_l2(const void* p) {
#ifdef NVP_HOST_EMULATION
  nvp_host_prefetch(p);  // the harness records the address
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// A lane's two rows of one matrix: codes and scales of rows n0 + g and n0 + g + 8, each clamped to the last
// row (a row past NOUT is read but its sums, in MMA rows of their own, are never stored). The scale pointers
// are the rows' (NVFP4) or their 128-row block's (block FP8).
struct Rows {
  const uint8_t* wa;
  const uint8_t* wb;
  const uint8_t* sa;
  const uint8_t* sb;
};

template <int SCALE_ROWS>
__device__ inline Rows rows_of(const uint8_t* w, const uint8_t* s, const Params& p, int64_t expert, int64_t ra,
                               int64_t rb) {
  ra = ra < p.NOUT ? ra : p.NOUT - 1;
  rb = rb < p.NOUT ? rb : p.NOUT - 1;
  return {w + expert * p.swe + ra * p.swn, w + expert * p.swe + rb * p.swn,
          s + expert * p.sse + (ra / SCALE_ROWS) * p.ssn, s + expert * p.sse + (rb / SCALE_ROWS) * p.ssn};
}

// This lane's share of the L2 prefetch of rows r's chunks ch0, ch0 + step, ... below K: the codes at its own
// column c (the 4 lanes of a row cover the chunk's bytes of that row) and the chunk's scales, from lane t = 0
// of each row pair (NVFP4: one scale row per output row) or from lane 0 alone (block FP8: the 16 rows share one
// 128-row scale block). Bytes per code column: NVFP4 1 / 2, FP8 1.
template <class F>
__device__ inline void prefetch_rows(const Rows& r, int64_t K, int64_t ch0, int64_t step, int64_t lane_col,
                                     int lane) {
  const bool scales = F::kScaleRows == 1 ? (lane & 3) == 0 : lane == 0;
  for (int64_t ch = ch0; ch * kChunk < K; ch += step) {
    const int64_t c = ch * kChunk + lane_col;
    if (c >= K) continue;
    prefetch_l2(r.wa + F::code_offset(c));
    prefetch_l2(r.wb + F::code_offset(c));
    if (scales) {
      prefetch_l2(r.sa + F::scale_offset(c));
      if (F::kScaleRows == 1) prefetch_l2(r.sb + F::scale_offset(c));
    }
  }
}

// How far ahead (in chunks, one chunk of each row set per step) the m32 form's rolling L2 prefetch asks:
// 4 chunks of two 16-row tiles, 4 KB of NVFP4 codes per warp (64 KB per SM at 16 warps) beyond the registers'.
constexpr int kPrefetchChunks = 4;

__device__ inline void load_x(const uint16_t* xr, int64_t c0, U4 (&x)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) x[q] = ld16(xr + c0 + 8 * q);
}

// load_x for NG token groups (x's rows xr), or zeros where kok is false (a lane's columns past K).
template <int NG>
__device__ inline void load_x_groups(const uint16_t* const (&xr)[NG], int64_t c0, bool kok, U4 (&x)[NG][4]) {
  const U4 zero = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
    if (kok)
      load_x(xr[grp], c0, x[grp]);
    else
      x[grp][0] = x[grp][1] = x[grp][2] = x[grp][3] = zero;
  }
}

// Word v rotated left by R bits (one funnel shift on the GPU).
template <int R>
__device__ inline uint32_t rotl(uint32_t v) {
#ifdef NVP_HOST_EMULATION
  return (v << R) | (v >> (32 - R));
#else
  return __funnelshift_l(v, v, R);
#endif
}

// NVFP4 (W4A16): codes [E, N, K / 2] (two e2m1 per byte, element 2j in the low nibble), e4m3 block scales
// [E, N, K / 16], weight_scale_2 [E]. REPACKED: the codes repacked at load time (Nvfp4Repacked below).
template <bool REPACKED>
struct Nvfp4Codes {
  static constexpr int kScaleRows = 1;
  // CTAs per SM of the per-pair persistent form (persistent_ctas_per_sm): its one-group pass fits 128
  // registers with no spill
  static constexpr int kPairCtasPerSm = 4;
  // byte offsets of column c's codes and scale within a row
  __device__ static int64_t code_offset(int64_t c) { return c / 2; }
  __device__ static int64_t scale_offset(int64_t c) { return c / 16; }
  // One lane's operands of one chunk: the codes of rows g and g + 8 (32 columns each), their two block scales
  // each, and x's 32 columns.
  struct C {
    U4 qa, qb, x[4];
    uint32_t sa, sb;
  };

  // The lane's operands at column c0 (a multiple of 32 below K: whole chunks need no predicate).
  __device__ static void load(const Rows& r, const uint16_t* xr, int64_t c0, bool with_x, C& c) {
    c.qa = ld16(r.wa + c0 / 2);
    c.qb = ld16(r.wb + c0 / 2);
    c.sa = ld2(r.sa + c0 / 16);
    c.sb = ld2(r.sb + c0 / 16);
    if (with_x) load_x(xr, c0, c.x);
  }

  // Element pair J of a code word as a bf16x2 of e2m1 * 2^-126: elements (J, J + 4) of the natural word
  // (e2m1_pair), or column pair (2J, 2J + 1) of a repacked one (magnitude at bits 6-8 / 22-24, sign at 15 /
  // 31: one to four integer operations).
  template <int J>
  __device__ static uint32_t pair(uint32_t v) {
    constexpr uint32_t kMask = 0x81C081C0u;
    if constexpr (!REPACKED)
      return e2m1_pair<J>(v);
    else if constexpr (J == 0)
      return v & kMask;
    else if constexpr (J == 1)
      return (v << 4) & kMask;
    else if constexpr (J == 2)
      return rotl<10>(v) & kMask;
    else
      return ((v << 6) & 0x80C080C0u) | ((v >> 2) & 0x01000100u);
  }

  // A fragment 2q + h of the chunk (bf16x2, e2m1 * scale * 2^-8): word q's element pairs 2h and 2h + 1 (pair:
  // natural (e0, e4), (e1, e5) or (e2, e6), (e3, e7); repacked columns (4h, 4h + 1), (4h + 2, 4h + 3)), rows g
  // and g + 8; Sa / Sb the rows' scale pairs (scale_pairs).
  template <int H>
  __device__ static void frag(const C& w, const uint32_t (&Sa)[2], const uint32_t (&Sb)[2], int q,
                              uint32_t (&a)[4]) {
    const uint32_t va = w.qa.v[q], vb = w.qb.v[q], sA = Sa[q >> 1], sB = Sb[q >> 1];
    a[0] = hmul2(pair<2 * H>(va), sA);
    a[1] = hmul2(pair<2 * H>(vb), sB);
    a[2] = hmul2(pair<2 * H + 1>(va), sA);
    a[3] = hmul2(pair<2 * H + 1>(vb), sB);
  }

  // x's columns of MMA 2q + h as its B registers, in frag's column order: natural, word q's pairs (0, 4),
  // (1, 5) (h = 0) or (2, 6), (3, 7) by byte permutes; repacked, x's words 2h and 2h + 1 as loaded.
  template <int H>
  __device__ static void xfrag(const U4 (&x)[4], int q, uint32_t& b0, uint32_t& b1) {
    if constexpr (REPACKED) {
      b0 = x[q].v[2 * H];
      b1 = x[q].v[2 * H + 1];
    } else {
      b0 = prmt(x[q].v[H], x[q].v[H + 2], 0x5410);
      b1 = prmt(x[q].v[H], x[q].v[H + 2], 0x7632);
    }
  }

  // acc += this lane's share of the chunk's 16 x 128 block times x: 8 MMAs, each fragment decoded just
  // before its MMA.
  __device__ static void mma(float (&acc)[4], const C& w, const U4 (&x)[4]) {
    uint32_t Sa[2], Sb[2], a[4], b0, b1;
    scale_pairs(w.sa, Sa[0], Sa[1]);
    scale_pairs(w.sb, Sb[0], Sb[1]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      frag<0>(w, Sa, Sb, q, a);
      xfrag<0>(x, q, b0, b1);
      mma16816(acc, a, b0, b1);
      frag<1>(w, Sa, Sb, q, a);
      xfrag<1>(x, q, b0, b1);
      mma16816(acc, a, b0, b1);
    }
  }

  // The chunk's 8 A fragments, decoded once (the grouped kernel multiplies them into several token groups).
  __device__ static void decode(const C& w, uint32_t (&A)[8][4]) {
    uint32_t Sa[2], Sb[2];
    scale_pairs(w.sa, Sa[0], Sa[1]);
    scale_pairs(w.sb, Sb[0], Sb[1]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      frag<0>(w, Sa, Sb, q, A[2 * q]);
      frag<1>(w, Sa, Sb, q, A[2 * q + 1]);
    }
  }

  // acc += the decoded chunk A times x's 32 columns of this lane: 8 MMAs (`s` unused: the scales are in A).
  __device__ static void mma_decoded(float (&acc)[4], const uint32_t (&A)[8][4], const U4 (&x)[4], float) {
    uint32_t b0, b1;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      xfrag<0>(x, q, b0, b1);
      mma16816(acc, A[2 * q], b0, b1);
      xfrag<1>(x, q, b0, b1);
      mma16816(acc, A[2 * q + 1], b0, b1);
    }
  }

  // mma_decoded with x's columns stored permuted (pair_cuda.X_PERM: each 8 columns in the order 0, 4, 1, 5, 2,
  // 6, 3, 7): the words of x[q] are the B registers as loaded, (e0, e4), (e1, e5), (e2, e6), (e3, e7), with
  // no byte permute.
  __device__ static void mma_decoded_xperm(float (&acc)[4], const uint32_t (&A)[8][4], const U4 (&x)[4],
                                           float) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      mma16816(acc, A[2 * q], x[q].v[0], x[q].v[1]);
      mma16816(acc, A[2 * q + 1], x[q].v[2], x[q].v[3]);
    }
  }

  __device__ static float chunk_scale(const C&) { return 0.0f; }  // the block scales are in the fragments

  // weight_scale_2, and the decode's 2^-126 times the scales' 2^118
  __device__ static float fold(const float* g, int64_t expert) { return g[expert] * 256.0f; }
};

using Nvfp4 = Nvfp4Codes<false>;

// NVFP4 with its code words repacked at load time (format "nvfp4_repacked": kernels.quant.nvfp4.repack_codes,
// the bit map REPACK_BITS there): each 32-bit word still holds the same 8 columns of one row, with its bits
// moved so that column pair (2j, 2j + 1) decodes to a bf16x2 (the same e2m1 * 2^-126 as e2m1_pair) in one or
// two integer operations for j = 0, 1, 2 and four for j = 3, against about four each from the natural
// nibble order, and so that x's words are the MMA's B registers as loaded, with no byte permute
// (Nvfp4Codes::pair and xfrag). Everything else (loads, scales, fold) is the natural format's: the repacking
// moves bits inside words only. Why: the pipelined grouped kernel's NVFP4 loop issues about 280 instructions
// per 1 KB of codes, 55 % of them the decode, about the SM's whole issue rate at the copy bandwidth.
// Measured, 29 % fewer loop instructions gave 4-8 %: issue is only part of the limit
// (docs/kernel_performance.md, "The NVFP4 decode's instruction count"). Source of the idea: Marlin's
// load-time repacking (Frantar et al., PPoPP 2025); the bit map here is this file's own, found by search over
// the rotations of the target bit set.
using Nvfp4Repacked = Nvfp4Codes<true>;

// Bytes b0 and b2 (I = 0) or b1 and b3 (I = 1) of a word of 4 e4m3 codes as a bf16x2 of e4m3 * 2^-120: the
// 7 magnitude bits to bf16 bits 4-10 (exponent 0-15, mantissa's top 3 bits; subnormals stay exact as bf16
// subnormals), the sign to 15 / 31.
template <int I>
__device__ inline uint32_t e4m3_pair(uint32_t v) {
  const uint32_t mag = (I == 0 ? (v << 4) : (v >> 4)) & 0x07F007F0u;
  return mag | ((I == 0 ? (v << 8) : v) & 0x80008000u);
}

// Block FP8 (W8A16, DeepSeek-V3's format): codes [E, N, K] e4m3, float32 weight_scale_inv [E, N / 128, K / 128]
// (one per 128 x 128 block). A chunk's 128 columns are one scale block and a CTA's 16 rows lie in one, so
// each chunk's MMAs go into zeroed accumulators that are then scaled once and added. REPACKED: the codes
// repacked at load time (BlockFp8Repacked below).
template <bool REPACKED>
struct BlockFp8Codes {
  static constexpr int kScaleRows = 128;
  // CTAs per SM of the per-pair persistent form (persistent_ctas_per_sm): at 4 (128 registers) its walk spills
  static constexpr int kPairCtasPerSm = 3;
  __device__ static int64_t code_offset(int64_t c) { return c; }
  __device__ static int64_t scale_offset(int64_t c) { return (c / kChunk) * 4; }
  struct C {
    U4 qa[2], qb[2], x[4];
    float s;
  };

  __device__ static void load(const Rows& r, const uint16_t* xr, int64_t c0, bool with_x, C& c) {
    c.qa[0] = ld16(r.wa + c0);
    c.qa[1] = ld16(r.wa + c0 + 16);
    c.qb[0] = ld16(r.wb + c0);
    c.qb[1] = ld16(r.wb + c0 + 16);
    c.s = ldf(r.sa + (c0 / kChunk) * 4);
    if (with_x) load_x(xr, c0, c.x);
  }

  // Code pair I of a word as a bf16x2 of e4m3 * 2^-120: bytes (I, I + 2) of the natural word (e4m3_pair), or
  // column pair (2I, 2I + 1) of a repacked one (1 and 4 integer operations).
  template <int I>
  __device__ static uint32_t pair(uint32_t v) {
    if constexpr (!REPACKED)
      return e4m3_pair<I>(v);
    else if constexpr (I == 0)
      return v & 0x87F087F0u;
    else
      return ((v << 4) & 0x00700070u) | (rotl<12>(v) & 0x87808780u);
  }

  // A fragment j of the chunk (bf16x2, the e4m3 values): word j (columns 4j..4j+3) of rows g and g + 8 as
  // its pairs 0 and 1 (natural: (b0, b2), (b1, b3); repacked: columns (0, 1), (2, 3)).
  __device__ static void frag(const C& w, int j, uint32_t (&a)[4]) {
    constexpr uint32_t kTwo120 = 0x7B807B80u;  // bf16x2 of 2^120: the decode's 2^-120 undone, exactly
    const uint32_t va = w.qa[j >> 2].v[j & 3], vb = w.qb[j >> 2].v[j & 3];
    a[0] = hmul2(pair<0>(va), kTwo120);
    a[1] = hmul2(pair<0>(vb), kTwo120);
    a[2] = hmul2(pair<1>(va), kTwo120);
    a[3] = hmul2(pair<1>(vb), kTwo120);
  }

  // x's columns 4j..4j+3 of this lane as MMA j's B registers, in frag's column order: natural, the pairs
  // (0, 2), (1, 3) by byte permutes; repacked, x's words as loaded.
  __device__ static void xfrag(const U4 (&x)[4], int j, uint32_t& b0, uint32_t& b1) {
    const uint32_t u0 = x[j >> 1].v[2 * (j & 1)], u1 = x[j >> 1].v[2 * (j & 1) + 1];
    if constexpr (REPACKED) {
      b0 = u0;
      b1 = u1;
    } else {
      b0 = prmt(u0, u1, 0x5410);
      b1 = prmt(u0, u1, 0x7632);
    }
  }

  // acc += scale * (this lane's share of the chunk's 16 x 128 block times x): 8 MMAs into zeroed
  // accumulators, each fragment decoded just before its MMA, then one scaling.
  __device__ static void mma(float (&acc)[4], const C& w, const U4 (&x)[4]) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t a[4], b0, b1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      frag(w, j, a);
      xfrag(x, j, b0, b1);
      mma16816(t, a, b0, b1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += t[i] * w.s;
  }

  // The chunk's 8 A fragments, decoded once (the grouped kernel multiplies them into several token groups).
  __device__ static void decode(const C& w, uint32_t (&A)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) frag(w, j, A[j]);
  }

  // acc += s * (the decoded chunk A times x's 32 columns of this lane).
  __device__ static void mma_decoded(float (&acc)[4], const uint32_t (&A)[8][4], const U4 (&x)[4], float s) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t b0, b1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      xfrag(x, j, b0, b1);
      mma16816(t, A[j], b0, b1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += t[i] * s;
  }

  __device__ static float chunk_scale(const C& c) { return c.s; }

  __device__ static float fold(const float*, int64_t) { return 1.0f; }
};

using BlockFp8 = BlockFp8Codes<false>;

// Block FP8 with its code words repacked at load time (format "block_fp8_repacked":
// kernels.quant.block_fp8.repack_codes, the bit map REPACK_BITS there): each 32-bit word still holds the same
// 4 columns of one row, with its bits moved so that column pairs (0, 1) and (2, 3) decode to bf16x2 of
// e4m3 * 2^-120 (as e4m3_pair) in 1 and 4 integer operations, against about 7 for both from the natural
// byte order, and so that x's words are the MMA's B registers as loaded (no byte permute; BlockFp8Codes::pair
// and xfrag). Everything else (loads, block scales) is the natural format's. Why and the idea's source:
// Nvfp4Repacked.
using BlockFp8Repacked = BlockFp8Codes<true>;

__device__ inline float activation(float v, int64_t act) {
  if (act == 1) {
    const float r = v > 0.0f ? v : 0.0f;
    return r * r;
  }
  if (act == 2) return v / (1.0f + expf(-v));
  return v;
}

template <class F, bool GATED>
__global__ void NVP_BOUNDS pair_gemv_kernel(const Params p) {
#ifdef NVP_HOST_EMULATION
  float* red = nvp_host_smem();
#else
  __shared__ float red[2 * kWarps * kRows];
#endif
  using C = typename F::C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t pair = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  // Before pdl_wait this reads only what the kernel before the previous one wrote at the latest (the pairs'
  // experts and the weights): under PDL the previous kernel, which writes x, may still be running.
  const int64_t expert = p.idx[pair];
  const uint16_t* xr = p.x + (pair / p.TOPK) * p.sxm;
  const Rows r1 = rows_of<F::kScaleRows>(p.w, p.s, p, expert, n0 + g, n0 + g + 8);
  Rows r2 = r1;
  if (GATED) r2 = rows_of<F::kScaleRows>(p.w2, p.s2, p, expert, n0 + g, n0 + g + 8);
  const int64_t lane_col = 32 * t;
  if (p.prefetch) {  // every chunk this warp will read, into L2 now: memory-level parallelism beyond registers
    prefetch_rows<F>(r1, p.K, warp, kWarps, lane_col, lane);
    if (GATED) prefetch_rows<F>(r2, p.K, warp, kWarps, lane_col, lane);
  }
  pdl_wait();  // x (the previous kernel's output under PDL) is read and out written only after this
  // A kernel launched after this one with PDL (the down projection after gate / up, pair_cuda.launch_pair's
  // `dependent`) may start its prologue once every CTA of this grid is past this point. Only after the wait:
  // a kernel launched with PDL after a PDL-launched one must not start before the first one's own producer is
  // done (its pre-wait reads are safe only against kernels older than its predecessor).
  pdl_launch_dependents();

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // whole chunks, two per step (warp w: chunks w and w + 4, then w + 8 and w + 12, ...): both chunks' loads
  // are issued before their MMAs
  const int64_t nfull = p.K / kChunk;
  for (int64_t ch = warp; ch < nfull; ch += 2 * kWarps) {
    const bool two = ch + kWarps < nfull;
    C c1, c2, d1, d2;
    F::load(r1, xr, ch * kChunk + lane_col, true, c1);
    if (GATED) F::load(r2, xr, ch * kChunk + lane_col, false, d1);
    if (two) {
      F::load(r1, xr, (ch + kWarps) * kChunk + lane_col, true, c2);
      if (GATED) F::load(r2, xr, (ch + kWarps) * kChunk + lane_col, false, d2);
    }
    F::mma(acc, c1, c1.x);
    if (GATED) F::mma(acc2, d1, c1.x);
    if (two) {
      F::mma(acc, c2, c2.x);
      if (GATED) F::mma(acc2, d2, c2.x);
    }
  }
  // the partial chunk (K % 128 columns, a multiple of 32): the next warp in turn. Lanes past K read the last
  // valid 32 columns' weights (finite, and in the chunk's own FP8 scale block, which every lane of the warp
  // must apply alike) against zeros for x, so they add nothing.
  if (p.K % kChunk != 0 && warp == nfull % kWarps) {
    const int64_t c0 = nfull * kChunk + lane_col;
    const bool kok = c0 < p.K;
    const int64_t cl = kok ? c0 : p.K - 32;
    C c, d;
    F::load(r1, xr, cl, true, c);
    if (GATED) F::load(r2, xr, cl, false, d);
    if (!kok) {
      const U4 zero = {{0u, 0u, 0u, 0u}};
      c.x[0] = c.x[1] = c.x[2] = c.x[3] = zero;
    }
    F::mma(acc, c, c.x);
    if (GATED) F::mma(acc2, d, c.x);
  }
  // every column of the MMA's N holds the same sums: lane (g, 0) has rows g (acc[0]) and g + 8 (acc[2])
  if (t == 0) {
    red[warp * kRows + g] = acc[0];
    red[warp * kRows + g + 8] = acc[2];
    if (GATED) {
      red[(kWarps + warp) * kRows + g] = acc2[0];
      red[(kWarps + warp) * kRows + g + 8] = acc2[2];
    }
  }
  __syncthreads();
  if (tid < kRows && n0 + tid < p.NOUT) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w * kRows + tid];
    float v = bf16_f32(bf16_rn(s * F::fold(p.g, expert)));  // the sum on bf16's grid
    if (p.act != 0) v = bf16_f32(bf16_rn(activation(v, p.act)));
    if (GATED) {
      float s2 = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s2 += red[(kWarps + w) * kRows + tid];
      v = bf16_f32(bf16_rn(v * bf16_f32(bf16_rn(s2 * F::fold(p.g2, expert)))));
    }
    p.out[pair * p.som + n0 + tid] = static_cast<uint16_t>(bf16_rn(v));
  }
}

// Token groups of 8 (the MMA's N) one pass of the grouped kernel multiplies each decoded chunk into.
constexpr int kGroups = 4;

// The grouped form (torch._grouped_mm's convention, no activation): rows offsets[e - 1] .. offsets[e] - 1 of x
// (sorted by expert) times expert e's matrix, out [P, NOUT] bf16. One CTA per (16 output rows, expert); an
// expert without rows returns at once. The expert's tokens are the MMA's N: lane (g, t) loads x of token
// 8 grp + g of each group grp, so one decoded chunk serves up to 8 kGroups tokens per pass (more tokens: more
// passes, each reading the weights again). Rows past the expert's last are read clamped (their MMA columns are
// never stored). The warps split K as the per-pair kernel's and meet in shared memory in warp order.
template <class F>
__global__ void NVP_BOUNDS grouped_gemv_kernel(const Params p) {
#ifdef NVP_HOST_EMULATION
  float* red = nvp_host_smem();
#else
  __shared__ float red[kWarps * 8 * kGroups * kRows];
#endif
  using C = typename F::C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = blockIdx.y;
  const int32_t* offs = reinterpret_cast<const int32_t*>(p.idx);
  const int64_t start = e > 0 ? offs[e - 1] : 0, end = offs[e];
  if (end <= start) return;  // the whole CTA: before any barrier
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const Rows r = rows_of<F::kScaleRows>(p.w, p.s, p, e, n0 + g, n0 + g + 8);
  const int64_t nchunks = (p.K + kChunk - 1) / kChunk;
  const int64_t lane_col = 32 * t;
  const U4 zero = {{0u, 0u, 0u, 0u}};
  for (int64_t tok0 = start; tok0 < end; tok0 += 8 * kGroups) {
    float acc[kGroups][4];
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) acc[grp][0] = acc[grp][1] = acc[grp][2] = acc[grp][3] = 0.0f;
    for (int64_t ch = warp; ch < nchunks; ch += kWarps) {
      const int64_t c0 = ch * kChunk + lane_col;
      const bool kok = c0 < p.K;  // the partial chunk's lanes past K: as in the per-pair kernel
      C c;
      F::load(r, nullptr, kok ? c0 : p.K - 32, false, c);
      uint32_t A[8][4];
      F::decode(c, A);
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        if (tok0 + 8 * grp < end) {  // the same for the whole warp
          int64_t row = tok0 + 8 * grp + g;
          row = row < end ? row : end - 1;
          U4 x[4];
          if (kok)
            load_x(p.x + row * p.sxm, c0, x);
          else
            x[0] = x[1] = x[2] = x[3] = zero;
          F::mma_decoded(acc[grp], A, x, F::chunk_scale(c));
        }
      }
    }
    // lane (g, t) holds rows g (acc[.][0..1]) and g + 8 (acc[.][2..3]) of tokens 8 grp + 2t, 8 grp + 2t + 1
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      const int tk = 8 * grp + 2 * t;
      red[(warp * 8 * kGroups + tk) * kRows + g] = acc[grp][0];
      red[(warp * 8 * kGroups + tk + 1) * kRows + g] = acc[grp][1];
      red[(warp * 8 * kGroups + tk) * kRows + g + 8] = acc[grp][2];
      red[(warp * 8 * kGroups + tk + 1) * kRows + g + 8] = acc[grp][3];
    }
    __syncthreads();
    const float fold = F::fold(p.g, e);
    for (int o = tid; o < 8 * kGroups * kRows; o += kThreads) {
      const int tk = o / kRows, row = o % kRows;
      if (tok0 + tk < end && n0 + row < p.NOUT) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += red[(w * 8 * kGroups + tk) * kRows + row];
        p.out[(tok0 + tk) * p.som + n0 + row] = static_cast<uint16_t>(bf16_rn(s * fold));
      }
    }
    __syncthreads();  // red is rewritten by the next pass
  }
}

// One output of the wide, pipelined and persistent forms: the sum times `fold` rounded to bf16 once; with an
// activation (act != 0: the per-pair persistent form) that value, activated, rounded again (pair_gemv_kernel's
// epilogue, ungated).
__device__ inline uint16_t tile_out(float sum, float fold, int64_t act) {
  if (act == 0) return static_cast<uint16_t>(bf16_rn(sum * fold));
  return static_cast<uint16_t>(bf16_rn(activation(bf16_f32(bf16_rn(sum * fold)), act)));
}

// The wide, pipelined and persistent forms' store of one warp's 16 rows for NG token groups from tok0: lane (g,
// t) holds rows g (acc[.][0..1]) and g + 8 (acc[.][2..3]) of tokens 8 grp + 2t and 8 grp + 2t + 1; each value
// tile_out's; tokens from `end` on and rows from NOUT on are not stored.
template <int NG>
__device__ inline void store_warp_tile(const Params& p, const float (&acc)[NG][4], int64_t tok0, int64_t end,
                                       float fold, int64_t n0, int g, int t, int64_t act = 0) {
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t tk = tok0 + 8 * grp + 2 * t + i;
      if (tk >= end) continue;
      if (n0 + g < p.NOUT) p.out[tk * p.som + n0 + g] = tile_out(acc[grp][i], fold, act);
      if (n0 + g + 8 < p.NOUT) p.out[tk * p.som + n0 + g + 8] = tile_out(acc[grp][2 + i], fold, act);
    }
  }
}

// Output rows per CTA of the wide grouped form: one MMA tile of 16 rows per warp.
constexpr int kWideRows = kRows * kWarps;

// The grouped form, wide (GROUPED_FORM "wide" in kernels/quant/pair_cuda.py): one CTA per (64 output rows,
// expert), warp w owning rows n0 + 16 w .. n0 + 16 w + 15 and walking every K chunk itself, two chunks' codes
// in flight per step. Why: in grouped_gemv_kernel each CTA has 16 rows and its warps split K, so every warp
// loads x for its own chunks: at 8 tokens per group that is 2 KB of x per 1 KB of NVFP4 codes, and with the
// ~11 rows per expert of a batch-64 verify the x traffic from L2 is 4x the weight bytes. Here the 4 warps of a
// CTA read the same x columns in the same step (the L1 cache serves the warps after the first) and the x bytes
// per weight byte are a quarter. Each lane's sums are final: no shared memory, no barrier (a warp whose rows
// all lie past NOUT leaves at once), each sum added in column order over K (a fixed order: the same bits
// eager and in a CUDA graph). Rows past the expert's last are read clamped and never stored, as in
// grouped_gemv_kernel; more than 32 rows take another pass over the weights.
template <class F>
__global__ void NVP_BOUNDS grouped_wide_kernel(const Params p) {
  using C = typename F::C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = blockIdx.y;
  const int32_t* offs = reinterpret_cast<const int32_t*>(p.idx);
  const int64_t start = e > 0 ? offs[e - 1] : 0, end = offs[e];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWideRows + kRows * warp;
  if (end <= start || n0 >= p.NOUT) return;
  const Rows r = rows_of<F::kScaleRows>(p.w, p.s, p, e, n0 + g, n0 + g + 8);
  const int64_t nfull = p.K / kChunk;
  const int64_t lane_col = 32 * t;
  const float fold = F::fold(p.g, e);
  for (int64_t tok0 = start; tok0 < end; tok0 += 8 * kGroups) {
    float acc[kGroups][4];
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) acc[grp][0] = acc[grp][1] = acc[grp][2] = acc[grp][3] = 0.0f;
    // the rows of x this lane reads: token 8 grp + g of each group (clamped to the expert's last)
    const uint16_t* xr[kGroups];
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      const int64_t row = tok0 + 8 * grp + g;
      xr[grp] = p.x + (row < end ? row : end - 1) * p.sxm;
    }
    // whole chunks, two per step: both chunks' codes are loaded before either is decoded
    for (int64_t ch = 0; ch < nfull; ch += 2) {
      const bool two = ch + 1 < nfull;
      C c1, c2;
      F::load(r, nullptr, ch * kChunk + lane_col, false, c1);
      if (two) F::load(r, nullptr, (ch + 1) * kChunk + lane_col, false, c2);
      uint32_t A[8][4];
      F::decode(c1, A);
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        if (tok0 + 8 * grp < end) {  // the same for the whole warp
          U4 x[4];
          load_x(xr[grp], ch * kChunk + lane_col, x);
          F::mma_decoded(acc[grp], A, x, F::chunk_scale(c1));
        }
      }
      if (two) {
        F::decode(c2, A);
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
          if (tok0 + 8 * grp < end) {
            U4 x[4];
            load_x(xr[grp], (ch + 1) * kChunk + lane_col, x);
            F::mma_decoded(acc[grp], A, x, F::chunk_scale(c2));
          }
        }
      }
    }
    // the partial chunk (K % 128 columns, a multiple of 32): lanes past K read the last valid 32 columns'
    // weights against zeros for x (grouped_gemv_kernel's rule: every lane applies the chunk's FP8 scale)
    if (p.K % kChunk != 0) {
      const int64_t c0 = nfull * kChunk + lane_col;
      const bool kok = c0 < p.K;
      C c;
      F::load(r, nullptr, kok ? c0 : p.K - 32, false, c);
      uint32_t A[8][4];
      F::decode(c, A);
      const U4 zero = {{0u, 0u, 0u, 0u}};
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        if (tok0 + 8 * grp < end) {
          U4 x[4];
          if (kok)
            load_x(xr[grp], c0, x);
          else
            x[0] = x[1] = x[2] = x[3] = zero;
          F::mma_decoded(acc[grp], A, x, F::chunk_scale(c));
        }
      }
    }
    store_warp_tile<kGroups>(p, acc, tok0, end, fold, n0, g, t);
  }
}

// acc[grp] += the decoded chunk A times group grp's x, for NG groups: F::mma_decoded, or with XP (x's columns
// stored permuted, pair_cuda.X_PERM) F::mma_decoded_xperm.
template <class F, int NG, bool XP>
__device__ inline void mma_groups(float (&acc)[NG][4], const uint32_t (&A)[8][4], const U4 (&x)[NG][4], float s) {
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
    if constexpr (XP)
      F::mma_decoded_xperm(acc[grp], A, x[grp], s);
    else
      F::mma_decoded(acc[grp], A, x[grp], s);
  }
}

// A warp's unit of work in the grouped persistent form: rows tok0 .. min(tok0 + 16, end) - 1 of the tokens
// sorted to expert e, against output rows n0 .. n0 + 15 (int32, as the offsets; NOUT < 2^31). ok false: the
// warp has no work left.
struct Work {
  int32_t e, n0, tok0, end;
  bool ok;
};

// The codes of whole chunks 0 and 1 of rows r (those of the nfull whole chunks that exist) into c: a pass's
// first step, loaded before the pass (by the caller, or by the previous pass of the persistent form).
template <class F>
__device__ inline void load_first_chunks(const Rows& r, int64_t nfull, int64_t lane_col, typename F::C (&c)[2]) {
  if (nfull > 0) F::load(r, nullptr, lane_col, false, c[0]);
  if (nfull > 1) F::load(r, nullptr, kChunk + lane_col, false, c[1]);
}

// One pass of the pipelined and persistent grouped forms over a warp's 16 rows for NG = 1 or 2 token groups
// (8 NG tokens from tok0, clamped to the expert's last row `end`; every group holds at least one row): acc
// [NG][4] as grouped_wide_kernel's. On entry cur holds the codes of whole chunks 0 and 1 (load_first_chunks).
// The codes of chunks ch + 2 and ch + 3 are loaded before chunks ch and ch + 1 are decoded and multiplied (two
// pairs of chunks in flight per warp, where the wide form waits for each pair), and every group's x of a chunk
// is loaded before the chunk's decode (NG fixed: no per-group branch for the loads to wait behind). NEXT (the
// persistent form): the pass's last step loads the first two chunks of the warp's next pass `nx` (when nx.ok)
// into cur, where the pipelined form loads nothing, so that the warp's loads do not stop between passes and
// tiles. Each sum is added in the wide form's order: the same bits. PER_PAIR (the per-pair persistent form):
// the rows tok0 .. end - 1 are pairs, pair q reading x's row q / TOPK, and the store applies p.act.
template <class F, int NG, bool XP, bool NEXT, bool PER_PAIR = false>
__device__ inline void pipelined_pass(const Params& p, const Rows& r, int64_t tok0, int64_t end, float fold,
                                      int64_t n0, int g, int t, typename F::C (&cur)[2], const Work& nx) {
  using C = typename F::C;
  const int64_t nfull = p.K / kChunk;
  const int64_t lane_col = 32 * t;
  float acc[NG][4];
  const uint16_t* xr[NG];
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
    acc[grp][0] = acc[grp][1] = acc[grp][2] = acc[grp][3] = 0.0f;
    const int64_t row = tok0 + 8 * grp + g;
    const int64_t xrow = row < end ? row : end - 1;
    xr[grp] = p.x + (PER_PAIR ? xrow / p.TOPK : xrow) * p.sxm;
  }
  // chunks ch and ch + 1 (when below nfull) of cur into acc
  const auto step = [&](int64_t ch) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j == 1 && ch + 1 >= nfull) break;
      const int64_t c0 = (ch + j) * kChunk + lane_col;
      U4 x[NG][4];
#pragma unroll
      for (int grp = 0; grp < NG; ++grp) load_x(xr[grp], c0, x[grp]);
      uint32_t A[8][4];
      F::decode(cur[j], A);
      mma_groups<F, NG, XP>(acc, A, x, F::chunk_scale(cur[j]));
    }
  };
  C nxt[2] = {};
  int64_t ch = 0;
  for (; ch + 2 < nfull; ch += 2) {
    F::load(r, nullptr, (ch + 2) * kChunk + lane_col, false, nxt[0]);
    if (ch + 3 < nfull) F::load(r, nullptr, (ch + 3) * kChunk + lane_col, false, nxt[1]);
    step(ch);
    cur[0] = nxt[0];
    cur[1] = nxt[1];
  }
  // the last step (one or two chunks), peeled: the persistent form's loads of the next pass go here, outside
  // the K loop
  if (ch < nfull) {
    if constexpr (NEXT) {
      if (nx.ok)
        load_first_chunks<F>(rows_of<F::kScaleRows>(p.w, p.s, p, nx.e, nx.n0 + g, nx.n0 + g + 8), nfull, lane_col,
                             nxt);
    }
    step(ch);
    if constexpr (NEXT) {
      cur[0] = nxt[0];
      cur[1] = nxt[1];
    }
  }
  // the partial chunk, as in grouped_wide_kernel
  if (p.K % kChunk != 0) {
    const int64_t c0 = nfull * kChunk + lane_col;
    const bool kok = c0 < p.K;
    C c;
    F::load(r, nullptr, kok ? c0 : p.K - 32, false, c);
    U4 x[NG][4];
    load_x_groups<NG>(xr, c0, kok, x);
    uint32_t A[8][4];
    F::decode(c, A);
    mma_groups<F, NG, XP>(acc, A, x, F::chunk_scale(c));
  }
  store_warp_tile<NG>(p, acc, tok0, end, fold, n0, g, t, PER_PAIR ? p.act : 0);
}

// Chunk 0 of two row sets (rows ra, rb: a gated pair's gate and up, or the m32 form's two tiles) into c[0] and
// c[1]: a two-set pass's first step, loaded before the pass (by the caller, or by the previous pass).
template <class F>
__device__ inline void load_first_two(const Rows& ra, const Rows& rb, int64_t nfull, int64_t lane_col,
                                      typename F::C (&c)[2]) {
  if (nfull == 0) return;
  F::load(ra, nullptr, lane_col, false, c[0]);
  F::load(rb, nullptr, lane_col, false, c[1]);
}

// acc_a += rows ra's codes times x and acc_b += rows rb's, over all of K, for NG token groups (x's rows xr):
// one chunk of each set per step, x loaded once for both, chunk ch + 1 of both in flight (the same code bytes
// in flight per warp as pipelined_pass's two chunks of one set). On entry cur holds chunk 0 of both
// (load_first_two). With NEXT the last step is peeled and load_next(nxt) loads the next pass's first chunks
// there, which cur holds on return; without it the loop is not peeled (at 128 registers the peeled form
// spilled inside the m32 form's K loop). Each sum is added over K in column order (pipelined_pass's order).
template <class F, int NG, bool XP, bool NEXT, bool PF, class LoadNext>
__device__ inline void two_set_chunks(const Params& p, const Rows& ra, const Rows& rb,
                                      const uint16_t* const (&xr)[NG], int t, float (&acc_a)[NG][4],
                                      float (&acc_b)[NG][4], typename F::C (&cur)[2], LoadNext&& load_next) {
  using C = typename F::C;
  const int64_t nfull = p.K / kChunk;
  const int64_t lane_col = 32 * t;
  // PF: the codes of whole chunk ch + kPrefetchChunks of both sets asked into L2 at step ch (chunks 2 ..
  // kPrefetchChunks - 1 before the loop; chunks 0 and 1 are loaded at once), so the register loads of the
  // chunks ahead find them there: bytes in flight beyond what the registers hold. Codes only (the scales are
  // an eighth of NVFP4's bytes), whole chunks only (a uniform branch, no per-lane bound): four prefetch
  // instructions a step.
  const auto prefetch = [&](int64_t ch) {
    if constexpr (PF) {
      if (ch < nfull) {
        const int64_t off = F::code_offset(ch * kChunk + lane_col);
        prefetch_l2(ra.wa + off);
        prefetch_l2(ra.wb + off);
        prefetch_l2(rb.wa + off);
        prefetch_l2(rb.wb + off);
      }
    }
  };
  if constexpr (PF) {
#pragma unroll
    for (int ch = 2; ch < kPrefetchChunks; ++ch) prefetch(ch);
  }
  // the chunk at column c0 of both sets (codes a, b) into acc_a, acc_b; x zero past K (kok false)
  const auto step = [&](int64_t c0, const C& a, const C& b, bool kok) {
    U4 x[NG][4];
    load_x_groups<NG>(xr, c0, kok, x);
    uint32_t A[8][4];
    F::decode(a, A);
    mma_groups<F, NG, XP>(acc_a, A, x, F::chunk_scale(a));
    F::decode(b, A);
    mma_groups<F, NG, XP>(acc_b, A, x, F::chunk_scale(b));
  };
  C nxt[2] = {};
  if constexpr (!NEXT) {  // nothing to load after the last chunk: no peeled step (fewer registers live)
    for (int64_t ch = 0; ch < nfull; ++ch) {
      prefetch(ch + kPrefetchChunks);  // a no-op without PF, and past the whole chunks
      if (ch + 1 < nfull) {
        F::load(ra, nullptr, (ch + 1) * kChunk + lane_col, false, nxt[0]);
        F::load(rb, nullptr, (ch + 1) * kChunk + lane_col, false, nxt[1]);
      }
      step(ch * kChunk + lane_col, cur[0], cur[1], true);
      cur[0] = nxt[0];
      cur[1] = nxt[1];
    }
  } else {
    int64_t ch = 0;
    for (; ch + 1 < nfull; ++ch) {
      F::load(ra, nullptr, (ch + 1) * kChunk + lane_col, false, nxt[0]);
      F::load(rb, nullptr, (ch + 1) * kChunk + lane_col, false, nxt[1]);
      step(ch * kChunk + lane_col, cur[0], cur[1], true);
      cur[0] = nxt[0];
      cur[1] = nxt[1];
    }
    if (ch < nfull) {  // the last step, peeled: the next pass's first chunks go out here
      load_next(nxt);
      step(ch * kChunk + lane_col, cur[0], cur[1], true);
      cur[0] = nxt[0];
      cur[1] = nxt[1];
    }
  }
  // the partial chunk, as in grouped_wide_kernel (lanes past K: the last valid columns against zeros)
  if (p.K % kChunk != 0) {
    const int64_t c0 = nfull * kChunk + lane_col;
    const bool kok = c0 < p.K;
    C a, b;
    F::load(ra, nullptr, kok ? c0 : p.K - 32, false, a);
    F::load(rb, nullptr, kok ? c0 : p.K - 32, false, b);
    step(c0, a, b, kok);
  }
}

// One gated pair's 16 rows n0 .. n0 + 15 in the per-pair persistent form: gate (p.w, rows r1) and up (p.w2,
// rows r2) of expert `expert` times x's row pair / TOPK, by two_set_chunks (on entry cur holds chunk 0 of
// both: load_first_two), whose last step loads the first chunks of the warp's next pass `nx` (when nx.ok).
// The store is pair_gemv_kernel's gated epilogue: the gate's sum times its fold on bf16's grid, activated and
// rounded, times the up sum's rounded value, rounded.
template <class F, bool NEXT>
__device__ inline void gated_pass(const Params& p, const Rows& r1, const Rows& r2, int64_t pair, int64_t expert,
                                  int64_t n0, int g, int t, typename F::C (&cur)[2], const Work& nx) {
  const uint16_t* const xr[1] = {p.x + (pair / p.TOPK) * p.sxm};
  float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, acc2[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  two_set_chunks<F, 1, false, NEXT, false>(p, r1, r2, xr, t, acc, acc2, cur, [&](typename F::C (&nxt)[2]) {
    if (nx.ok)
      load_first_two<F>(rows_of<F::kScaleRows>(p.w, p.s, p, nx.e, nx.n0 + g, nx.n0 + g + 8),
                        rows_of<F::kScaleRows>(p.w2, p.s2, p, nx.e, nx.n0 + g, nx.n0 + g + 8), p.K / kChunk,
                        32 * t, nxt);
  });
  // every column of the MMA's N holds the pair's sums: lane (g, 0) has rows g ([0]) and g + 8 ([2])
  if (t != 0) return;
  const float fold1 = F::fold(p.g, expert), fold2 = F::fold(p.g2, expert);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n0 + g + 8 * h;
    if (n >= p.NOUT) continue;
    float v = bf16_f32(bf16_rn(acc[0][2 * h] * fold1));
    if (p.act != 0) v = bf16_f32(bf16_rn(activation(v, p.act)));
    v = bf16_f32(bf16_rn(v * bf16_f32(bf16_rn(acc2[0][2 * h] * fold2))));
    p.out[pair * p.som + n] = static_cast<uint16_t>(bf16_rn(v));
  }
}

// The grouped form, pipelined (GROUPED_FORM "pipelined"): grouped_wide_kernel's grid and rows (one CTA per 64
// output rows and expert, a warp per 16 rows over all of K, no shared memory or barrier), the expert's rows
// in passes of up to 16 (two token groups), each run by pipelined_pass for its group count. Why: in the wide
// form a warp waits for each pair of chunks' codes before it decodes them, and each token group's x loads wait
// behind the previous group's MMAs (the group count is known only at run time), so at ~11 rows per expert (a
// batch-64 verify, two groups) NVFP4 ran at 34 % of the copy bandwidth (docs/kernel_performance.md). Passes
// of up to 32 rows (the wide form's) would need ~175 registers a thread (two CTAs per SM instead of four); past
// 16 rows an expert's weights are read again, mostly from L2. The occupancy bound (4 CTAs of 128 threads per
// SM) holds NVFP4 at 127 registers, no spill (benchmarks/compile_report.py).
template <class F, bool XP>
__global__ void NVP_BOUNDS_OCC(4) grouped_pipelined_kernel(const Params p) {
  using C = typename F::C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = blockIdx.y;
  const int32_t* offs = reinterpret_cast<const int32_t*>(p.idx);
  const int64_t start = e > 0 ? offs[e - 1] : 0, end = offs[e];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWideRows + kRows * warp;
  if (end <= start || n0 >= p.NOUT) return;
  const Rows r = rows_of<F::kScaleRows>(p.w, p.s, p, e, n0 + g, n0 + g + 8);
  const float fold = F::fold(p.g, e);
  const int64_t nfull = p.K / kChunk;
  const Work none = {0, 0, 0, 0, false};
  for (int64_t tok0 = start; tok0 < end; tok0 += 16) {
    C cur[2] = {};
    load_first_chunks<F>(r, nfull, 32 * t, cur);
    const int64_t ng = (end - tok0 + 7) / 8;
    if (ng >= 2)
      pipelined_pass<F, 2, XP, false>(p, r, tok0, end, fold, n0, g, t, cur, none);
    else
      pipelined_pass<F, 1, XP, false>(p, r, tok0, end, fold, n0, g, t, cur, none);
  }
}

// One pass of grouped_m32_kernel over a warp's 32 rows, two MMA tiles (rows ra: n0 + g, n0 + g + 8; rb: n0 + 16
// + g, n0 + 24 + g), for NG token groups as pipelined_pass's, by two_set_chunks: each step loads x once for
// both tiles. Each sum is added over K in the pipelined form's order: the same bits.
template <class F, int NG, bool XP, bool PF>
__device__ inline void m32_pass(const Params& p, const Rows& ra, const Rows& rb, int64_t tok0, int64_t end,
                                float fold, int64_t n0, int g, int t) {
  float acc[2][NG][4];
  const uint16_t* xr[NG];
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
    const int64_t row = tok0 + 8 * grp + g;
    xr[grp] = p.x + (row < end ? row : end - 1) * p.sxm;
#pragma unroll
    for (int m = 0; m < 2; ++m) acc[m][grp][0] = acc[m][grp][1] = acc[m][grp][2] = acc[m][grp][3] = 0.0f;
  }
  typename F::C cur[2] = {};
  load_first_two<F>(ra, rb, p.K / kChunk, 32 * t, cur);
  two_set_chunks<F, NG, XP, false, PF>(p, ra, rb, xr, t, acc[0], acc[1], cur, [](typename F::C (&)[2]) {});
  store_warp_tile<NG>(p, acc[0], tok0, end, fold, n0, g, t);
  store_warp_tile<NG>(p, acc[1], tok0, end, fold, n0 + kRows, g, t);
}

// Output rows per CTA of the m32 grouped form: two MMA tiles per warp.
constexpr int kM32Rows = 2 * kRows * kWarps;

// The grouped form with 32 output rows per warp (GROUPED_FORM "m32"): one CTA per 128 output rows and expert,
// warp w owning rows n0 + 32 w .. n0 + 32 w + 31 as two MMA tiles over all of K (m32_pass), the expert's rows in
// passes of up to 16. Why: in the pipelined form each warp loads x for every chunk and token group, and at two
// token groups NVFP4 moves 4x block FP8's x bytes through L1 per weight byte; Nsight Compute finds NVFP4's
// kernel at about half of DRAM's peak with the L1 data path 70-75 % busy (docs/kernel_performance.md, "The
// persistent forms of the routed experts' CUDA kernels"). Here each x fragment feeds both tiles: half the x
// bytes per weight byte, with the same code bytes in flight per warp. The same bits as the pipelined form.
// sm_90 build at 4 CTAs per SM: NVFP4 128 / 124 registers (natural / repacked), its K loops without spills;
// block FP8 spills inside its two-group loop, and this form is meant for NVFP4 (block FP8's pipelined form
// reads near DRAM's peak already). N not a multiple of 32 makes a warp read a second, clamped tile's codes.
// With XP (NVFP4, pair_cuda.X_PERM) x's columns come permuted and each x word is an MMA B register as
// loaded, as in grouped_pipelined_kernel<Nvfp4, true>: the same products in the same order, the same bits.
// With PF (NVFP4, natural or repacked; pair_cuda.GROUPED_PREFETCH, p.prefetch) each warp asks for its codes
// and scales kPrefetchChunks chunks ahead into L2 (two_set_chunks): Nsight Compute found the m32 kernel's
// warps still waiting on global loads with DRAM at 58-62 % of its peak (docs/kernel_performance.md, "The m32
// grouped form"), each warp holding one step ahead in registers. The same loads: the same bits.
template <class F, bool XP, bool PF = false>
__global__ void NVP_BOUNDS_OCC(4) grouped_m32_kernel(const Params p) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t e = blockIdx.y;
  const int32_t* offs = reinterpret_cast<const int32_t*>(p.idx);
  const int64_t start = e > 0 ? offs[e - 1] : 0, end = offs[e];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kM32Rows + 2 * kRows * warp;
  if (end <= start || n0 >= p.NOUT) return;
  const Rows ra = rows_of<F::kScaleRows>(p.w, p.s, p, e, n0 + g, n0 + g + 8);
  const Rows rb = rows_of<F::kScaleRows>(p.w, p.s, p, e, n0 + kRows + g, n0 + kRows + g + 8);
  const float fold = F::fold(p.g, e);
  for (int64_t tok0 = start; tok0 < end; tok0 += 16) {
    if (end - tok0 > 8)
      m32_pass<F, 2, XP, PF>(p, ra, rb, tok0, end, fold, n0, g, t);
    else
      m32_pass<F, 1, XP, PF>(p, ra, rb, tok0, end, fold, n0, g, t);
  }
}

// The persistent forms' tiles: tile i is row block i % nblk (64 output rows, nblk = ceil(NOUT / 64)) of expert
// i / nblk (grouped) or of pair i / nblk (per pair); nblk * E or nblk * P tiles.
__device__ inline int64_t row_blocks(const Params& p) { return (p.NOUT + kWideRows - 1) / kWideRows; }

// Warp `warp`'s first work at or after tile `tile` in steps of `stride` (the grid's CTAs): the first tile whose
// 16 rows of this warp start below NOUT and, grouped, whose expert has rows, its first pass (per pair: the
// pair's expert, its one row); `tile` is left at that tile (past the last when none is left, ok false).
template <bool PER_PAIR>
__device__ inline Work find_work(const Params& p, int64_t& tile, int64_t stride, int warp) {
  const int64_t nblk = row_blocks(p), ntiles = nblk * (PER_PAIR ? p.P : p.E);
  for (; tile < ntiles; tile += stride) {
    const int64_t q = tile / nblk;
    const int64_t n0 = (tile - q * nblk) * kWideRows + kRows * warp;
    if (n0 >= p.NOUT) continue;
    if constexpr (PER_PAIR) {
      return {static_cast<int32_t>(p.idx[q]), static_cast<int32_t>(n0), static_cast<int32_t>(q),
              static_cast<int32_t>(q + 1), true};
    } else {
      const int32_t* offs = reinterpret_cast<const int32_t*>(p.idx);
      const int32_t start = q > 0 ? offs[q - 1] : 0, end = offs[q];
      if (end > start) return {static_cast<int32_t>(q), static_cast<int32_t>(n0), start, end, true};
    }
  }
  return {0, 0, 0, 0, false};
}

// CTAs per SM of the grouped persistent form. Why 3 and not the pipelined form's 4: the walk's state (the next
// pass, the tile) on top of the pipelined pass's 124-128 registers spilled at 128 (block FP8 inside its K
// loop); at 3 CTAs (168 registers) nothing spills (benchmarks/compile_report.py), and each warp keeps its loads
// going across passes instead.
constexpr int kPersistentCtasPerSm = 3;

// CTAs per SM of persistent_kernel<F, PER_PAIR>: its occupancy bound, and its default grid's CTAs per SM
// (persistent_grid).
template <class F, bool PER_PAIR, bool GATED = false>
constexpr int persistent_ctas_per_sm() {
  return PER_PAIR && !GATED ? F::kPairCtasPerSm : kPersistentCtasPerSm;
}

// The persistent forms: a grid of p.ctas CTAs (persistent_grid: by default persistent_ctas_per_sm per SM, at
// most one per tile), CTA b taking tiles b, b + ctas, ... (row_blocks), each warp its 16 rows of each tile
// over all of K in passes of up to 16 rows, as the pipelined form's. Each warp walks its own tiles (no shared
// memory, no barrier) and, in each pass's last step, loads the next pass's first two chunks (pipelined_pass
// or gated_pass with NEXT), the next tile's included.
// - Grouped (GROUPED_FORM "persistent", PER_PAIR false): the grouped kernels' arguments, the expert's rows in
//   passes of up to 16. Why: in the pipelined form each CTA starts with its first two chunks' loads exposed and
//   ends with nothing in flight; at Super V3's up projection (K = 1024: 8 chunks, 4 steps a warp) that is a
//   large share of each CTA's life, and the form's 29 % fewer decode instructions on repacked codes bought
//   only 4-8 % (docs/kernel_performance.md, "The NVFP4 decode's instruction count"). Every output gets the
//   pipelined form's sums in the same order: the same bits, whatever the grid.
// - Per pair (PAIR_FORM "persistent", PER_PAIR true): pair_gemv_kernel's arguments, each tile one pair's 64
//   rows (x's row pair / TOPK, its expert idx[pair]), the activation applied as pair_gemv_kernel applies it;
//   GATED (a gated pair, p.gated): gate and up together (gated_pass), pair_gemv_kernel's gated epilogue. Why: pair_gemv_kernel's CTAs split K over their warps, so at Super V3's up
//   projection each warp loads two chunks and is done, and each wave of CTAs waits for one DRAM round trip
//   (1.35 TB/s at one token, docs/kernel_performance.md, "The CUDA kernels at the release shapes"). Each sum
//   here is added over K in column order by one warp: not pair_gemv_kernel's order (its warps' partial sums),
//   so not its bits; the same bits eager and in a CUDA graph. Under PDL it waits for the previous kernel
//   before its first load of anything.
// Measured on an H100, both are slower than the kernels they were to replace (the grouped form by 4-16 % at
// 64-256 tokens, the per-pair form by 7-32 % at one token): a drained load queue at CTA ends was not the
// limit; the profile points at the x loads through L1 and at the fewer warps per SM of these forms
// (docs/kernel_performance.md, "The persistent forms of the routed experts' CUDA kernels"). They stay as
// options (pair_cuda.GROUPED_FORM / PAIR_FORM), not defaults.
template <class F, bool PER_PAIR, bool GATED = false>
__global__ void NVP_BOUNDS_OCC((persistent_ctas_per_sm<F, PER_PAIR, GATED>())) persistent_kernel(const Params p) {
  using C = typename F::C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t stride = gridDim.x, nfull = p.K / kChunk;
  if constexpr (PER_PAIR) {
    pdl_wait();
    pdl_launch_dependents();
  }
  int64_t tile = blockIdx.x;
  Work w = find_work<PER_PAIR>(p, tile, stride, warp);
  if (!w.ok) return;
  C cur[2] = {};
  if constexpr (GATED)
    load_first_two<F>(rows_of<F::kScaleRows>(p.w, p.s, p, w.e, w.n0 + g, w.n0 + g + 8),
                      rows_of<F::kScaleRows>(p.w2, p.s2, p, w.e, w.n0 + g, w.n0 + g + 8), nfull, 32 * t, cur);
  else
    load_first_chunks<F>(rows_of<F::kScaleRows>(p.w, p.s, p, w.e, w.n0 + g, w.n0 + g + 8), nfull, 32 * t, cur);
  while (w.ok) {
    Work nx = w;
    if (w.tok0 + 16 < w.end) {
      nx.tok0 += 16;
    } else {
      tile += stride;
      nx = find_work<PER_PAIR>(p, tile, stride, warp);
    }
    const Rows r = rows_of<F::kScaleRows>(p.w, p.s, p, w.e, w.n0 + g, w.n0 + g + 8);
    if constexpr (GATED) {
      const Rows r2 = rows_of<F::kScaleRows>(p.w2, p.s2, p, w.e, w.n0 + g, w.n0 + g + 8);
      gated_pass<F, true>(p, r, r2, w.tok0, w.e, w.n0, g, t, cur, nx);
      w = nx;
      continue;
    }
    const float fold = F::fold(p.g, w.e);
    if (!PER_PAIR && w.end - w.tok0 > 8)  // a pair is one row: its instance has no two-group pass
      pipelined_pass<F, 2, false, true, PER_PAIR>(p, r, w.tok0, w.end, fold, w.n0, g, t, cur, nx);
    else
      pipelined_pass<F, 1, false, true, PER_PAIR>(p, r, w.tok0, w.end, fold, w.n0, g, t, cur, nx);
    w = nx;
  }
}

__host__ inline Params params_of(void* const* ptrs, const long long* ints) {
  Params p;
  p.x = static_cast<const uint16_t*>(ptrs[0]);
  p.idx = static_cast<const int64_t*>(ptrs[1]);
  p.w = static_cast<const uint8_t*>(ptrs[2]);
  p.s = static_cast<const uint8_t*>(ptrs[3]);
  p.g = static_cast<const float*>(ptrs[4]);
  p.w2 = static_cast<const uint8_t*>(ptrs[5]);
  p.s2 = static_cast<const uint8_t*>(ptrs[6]);
  p.g2 = static_cast<const float*>(ptrs[7]);
  p.out = static_cast<uint16_t*>(ptrs[8]);
  p.P = ints[0];
  p.NOUT = ints[1];
  p.K = ints[2];
  p.TOPK = ints[3];
  p.act = ints[4];
  p.gated = ints[5];
  p.sxm = ints[6];
  p.swe = ints[7];
  p.swn = ints[8];
  p.sse = ints[9];
  p.ssn = ints[10];
  p.som = ints[11];
  p.fmt = ints[12];
  p.E = ints[13];
  p.prefetch = ints[14];
  p.pdl = ints[15];
  p.form = ints[16];
  p.xperm = ints[17];
  p.ctas = ints[18];
  p.sms = 0;
  return p;
}

// Format codes of Params.fmt (kernels/quant/pair_cuda.py's FORMATS).
constexpr int64_t kFmtNvfp4 = 0, kFmtBlockFp8 = 1, kFmtNvfp4Repacked = 2, kFmtBlockFp8Repacked = 3;

// A launch's grid: x CTAs by y.
struct Grid {
  int64_t x, y;
};

// The grid of persistent_kernel<F, PER_PAIR, GATED>: p.ctas CTAs, or by default (p.ctas 0)
// persistent_ctas_per_sm per SM (p.sms), either at most one per tile (row_blocks of E experts or P pairs).
template <class F, bool PER_PAIR, bool GATED = false>
inline Grid persistent_grid(const Params& p) {
  const int64_t tiles = (p.NOUT + kWideRows - 1) / kWideRows * (PER_PAIR ? p.P : p.E);
  const int64_t ctas = p.ctas > 0 ? p.ctas : persistent_ctas_per_sm<F, PER_PAIR, GATED>() * p.sms;
  return {ctas < tiles ? ctas : tiles, 1};
}

// run(the per-pair persistent kernel of format F, gated or not, its grid).
template <class F, class Run>
inline void run_pair_persistent(const Params& p, Run&& run) {
  if (p.gated)
    run(persistent_kernel<F, true, true>, persistent_grid<F, true, true>(p));
  else
    run(persistent_kernel<F, true, false>, persistent_grid<F, true, false>(p));
}

// The kernel of one launch and its grid, handed to run(kernel, grid); the one place that maps (format,
// gating, grouped form, x layout) to an instantiation and a grid, for the device launchers below and the host
// harness. Per pair (grouped false): form 0 pair_gemv_kernel of each format, gated or not, on (NOUT / 16, P);
// form 3 persistent_kernel<F, true, gated> (every format) on persistent_grid. Grouped: form 3
// persistent_kernel<F, false> (every format) on persistent_grid; form 4 grouped_m32_kernel (every format;
// X_PERM NVFP4 only; prefetch NVFP4 natural and repacked only) on (NOUT / 128, E); form 2 grouped_pipelined_kernel (every format;
// X_PERM NVFP4 only) and 1 grouped_wide_kernel (NVFP4 and block FP8) on (NOUT / 64, E); 0 grouped_gemv_kernel
// (NVFP4 and block FP8) on (NOUT / 16, E). Returns false, having run nothing, for a combination without a
// kernel (an unknown format or form, X_PERM or a grouped prefetch elsewhere, a repacked format in grouped forms
// 0 and 1, a persistent form with neither p.ctas nor p.sms).
template <class Run>
inline bool dispatch(const Params& p, bool grouped, Run&& run) {
  if (p.fmt < kFmtNvfp4 || p.fmt > kFmtBlockFp8Repacked) return false;
  const bool repacked = p.fmt == kFmtNvfp4Repacked || p.fmt == kFmtBlockFp8Repacked;
  const int64_t tiles16 = (p.NOUT + kRows - 1) / kRows, tiles64 = (p.NOUT + kWideRows - 1) / kWideRows;
  if (!grouped) {
    if (p.form != 0 && p.form != 3) return false;
    if (p.form == 3) {
      if (p.ctas <= 0 && p.sms <= 0) return false;
      if (p.fmt == kFmtNvfp4)
        run_pair_persistent<Nvfp4>(p, run);
      else if (p.fmt == kFmtBlockFp8)
        run_pair_persistent<BlockFp8>(p, run);
      else if (p.fmt == kFmtNvfp4Repacked)
        run_pair_persistent<Nvfp4Repacked>(p, run);
      else
        run_pair_persistent<BlockFp8Repacked>(p, run);
      return true;
    }
    const Grid grid = {tiles16, p.P};
    if (p.fmt == kFmtNvfp4)
      run(p.gated ? pair_gemv_kernel<Nvfp4, true> : pair_gemv_kernel<Nvfp4, false>, grid);
    else if (p.fmt == kFmtBlockFp8)
      run(p.gated ? pair_gemv_kernel<BlockFp8, true> : pair_gemv_kernel<BlockFp8, false>, grid);
    else if (p.fmt == kFmtNvfp4Repacked)
      run(p.gated ? pair_gemv_kernel<Nvfp4Repacked, true> : pair_gemv_kernel<Nvfp4Repacked, false>, grid);
    else
      run(p.gated ? pair_gemv_kernel<BlockFp8Repacked, true> : pair_gemv_kernel<BlockFp8Repacked, false>, grid);
    return true;
  }
  if (p.form < 0 || p.form > 4 || (p.xperm && ((p.form != 2 && p.form != 4) || p.fmt != kFmtNvfp4)) ||
      (p.prefetch && (p.form != 4 || (p.fmt != kFmtNvfp4 && p.fmt != kFmtNvfp4Repacked))) ||
      (repacked && p.form < 2) || (p.form == 3 && p.ctas <= 0 && p.sms <= 0))
    return false;
  if (p.form == 3) {
    if (p.fmt == kFmtNvfp4)
      run(persistent_kernel<Nvfp4, false>, persistent_grid<Nvfp4, false>(p));
    else if (p.fmt == kFmtBlockFp8)
      run(persistent_kernel<BlockFp8, false>, persistent_grid<BlockFp8, false>(p));
    else if (p.fmt == kFmtNvfp4Repacked)
      run(persistent_kernel<Nvfp4Repacked, false>, persistent_grid<Nvfp4Repacked, false>(p));
    else
      run(persistent_kernel<BlockFp8Repacked, false>, persistent_grid<BlockFp8Repacked, false>(p));
  } else if (p.form == 4) {
    const Grid grid = {(p.NOUT + kM32Rows - 1) / kM32Rows, p.E};
    if (p.fmt == kFmtNvfp4)
      run(p.prefetch ? (p.xperm ? grouped_m32_kernel<Nvfp4, true, true> : grouped_m32_kernel<Nvfp4, false, true>)
                     : (p.xperm ? grouped_m32_kernel<Nvfp4, true> : grouped_m32_kernel<Nvfp4, false>),
          grid);
    else if (p.fmt == kFmtBlockFp8)
      run(grouped_m32_kernel<BlockFp8, false>, grid);
    else if (p.fmt == kFmtNvfp4Repacked)
      run(p.prefetch ? grouped_m32_kernel<Nvfp4Repacked, false, true> : grouped_m32_kernel<Nvfp4Repacked, false>,
          grid);
    else
      run(grouped_m32_kernel<BlockFp8Repacked, false>, grid);
  } else if (p.form == 2) {
    const Grid grid = {tiles64, p.E};
    if (p.fmt == kFmtNvfp4)
      run(p.xperm ? grouped_pipelined_kernel<Nvfp4, true> : grouped_pipelined_kernel<Nvfp4, false>, grid);
    else if (p.fmt == kFmtBlockFp8)
      run(grouped_pipelined_kernel<BlockFp8, false>, grid);
    else if (p.fmt == kFmtNvfp4Repacked)
      run(grouped_pipelined_kernel<Nvfp4Repacked, false>, grid);
    else
      run(grouped_pipelined_kernel<BlockFp8Repacked, false>, grid);
  } else if (p.form == 1) {
    run(p.fmt == kFmtNvfp4 ? grouped_wide_kernel<Nvfp4> : grouped_wide_kernel<BlockFp8>, Grid{tiles64, p.E});
  } else {
    run(p.fmt == kFmtNvfp4 ? grouped_gemv_kernel<Nvfp4> : grouped_gemv_kernel<BlockFp8>, Grid{tiles16, p.E});
  }
  return true;
}

#ifndef NVP_HOST_EMULATION
// p.sms for a persistent launch of the default grid (form 3, p.ctas 0): the current device's SMs, asked of
// the driver once per device (the first launch, eager in every caller, before any CUDA-graph capture) and
// cached. Returns cudaSuccess or the device query's error.
inline cudaError_t fill_sms(Params& p) {
  if (p.form != 3 || p.ctas != 0) return cudaSuccess;
  static std::atomic<int> cached[64];  // SMs per device ordinal, 0 until asked
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const bool cacheable = device >= 0 && device < 64;
  int sms = cacheable ? cached[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
    if (cacheable) cached[device].store(sms, std::memory_order_relaxed);
  }
  p.sms = sms;
  return cudaSuccess;
}

// kernel<<<grid, kThreads, 0, st>>>(p), with the programmatic-stream-serialization attribute when p.pdl (the
// kernel may begin while the previous kernel on `st` finishes; it waits for it in pdl_wait). Recorded as a
// programmatic edge under CUDA-graph capture. Returns cudaLaunchKernelEx's error (cudaSuccess for <<<>>>,
// whose errors cudaGetLastError reports).
template <class K>
inline cudaError_t launch(K kernel, dim3 grid, cudaStream_t st, const Params& p) {
  if (!p.pdl) {
    kernel<<<grid, kThreads, 0, st>>>(p);
    return cudaSuccess;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}
#endif

}  // namespace nvp

extern "C" {

__attribute__((visibility("default"))) int nvp_abi() { return NVP_ABI; }

#ifndef NVP_HOST_EMULATION
// Launch on `stream` (the caller's current stream, so CUDA-graph capture records it); no allocation, no sync.
// ptrs (9): x, idx, w, s, g, w2, s2, g2 (the last three unused unless gated), out.
// ints (19): P, NOUT, K, TOPK, act (0 none, 1 relu2, 2 silu), gated (0/1), the strides in the order of
//   Params (x / out rows in elements, codes / scales in bytes), the format (0 NVFP4, 1 block FP8, 2 NVFP4
//   repacked, 3 block FP8 repacked), E,
//   prefetch (0/1: the CTA's weights into L2 before its loop), pdl (0/1: a programmatic dependent launch,
//   sm_90+ only; the kernel reads x and writes out only after the previous kernel completes), form (0
//   pair_gemv_kernel, 3 the per-pair persistent_kernel: prefetch ignored), xperm (the grouped
//   form's x layout; unused here), ctas (the persistent form's grid, 0 for its default:
//   nvp::persistent_grid).
// Returns 0, or a cudaError_t code (nvp_error_string names it).
__attribute__((visibility("default"))) int nvp_launch(void* const* ptrs, const long long* ints, void* stream) {
  nvp::Params p = nvp::params_of(ptrs, ints);
  if (p.P <= 0 || p.NOUT <= 0) return 0;
  const cudaError_t qe = nvp::fill_sms(p);
  if (qe != cudaSuccess) return static_cast<int>(qe);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaSuccess;
  const bool known = nvp::dispatch(p, false, [&](auto kernel, nvp::Grid grid) {
    e = nvp::launch(kernel, dim3(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y)), st, p);
  });
  if (!known) return static_cast<int>(cudaErrorInvalidValue);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not left behind for the next launch's check
    return static_cast<int>(e);
  }
  return static_cast<int>(cudaGetLastError());  // also an earlier asynchronous error, as any launch check
}

// The grouped form: ptrs as nvp_launch with idx = offsets (int32 [E], cumulative row ends); ints as nvp_launch
// (TOPK, act, gated and pdl unused; prefetch: the m32 form's rolling L2 prefetch, NVFP4 natural and repacked
// only) with ints[13] = E and ints[16] = the form: 3
// persistent_kernel on a grid of ints[18] CTAs, 4 grouped_m32_kernel on (NOUT / 128, E), 2
// grouped_pipelined_kernel and 1 grouped_wide_kernel on
// (NOUT / 64, E), 0 grouped_gemv_kernel on (NOUT / 16, E); ints[17] = xperm (x's columns stored permuted,
// pair_cuda.X_PERM). ints[18] = 0 (the persistent form's default grid): nvp::persistent_grid. A
// combination without a kernel (nvp::dispatch) is cudaErrorInvalidValue.
__attribute__((visibility("default"))) int nvp_launch_grouped(void* const* ptrs, const long long* ints,
                                                              void* stream) {
  nvp::Params p = nvp::params_of(ptrs, ints);
  if (p.P <= 0 || p.NOUT <= 0 || p.E <= 0) return 0;
  const cudaError_t qe = nvp::fill_sms(p);
  if (qe != cudaSuccess) return static_cast<int>(qe);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool known = nvp::dispatch(p, true, [&](auto kernel, nvp::Grid grid) {
    kernel<<<dim3(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y)), nvp::kThreads, 0, st>>>(p);
  });
  if (!known) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaGetLastError());
}

__attribute__((visibility("default"))) const char* nvp_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
#endif  // NVP_HOST_EMULATION

}  // extern "C"
