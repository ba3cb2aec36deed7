// Matrix products for XLA's CPU backend (XLA FFI handlers): y = x @ W, float32 out, any rows.
//
// Decode multiplies a handful of activation rows by every weight of the model, once per
// token, so a step is bound by how fast the weights stream from memory. XLA's CPU path
// dequantizes a quantized weight into a float32 copy before its dot (several times the
// bytes), and its float32 matrix-vector product reaches about half the bandwidth. These
// kernels read each weight element once, widen it in registers, and keep every row's
// partial sums in registers. Prefill's many rows take the same kernels, blocked so that a
// converted weight panel serves every row while it is in cache.
//
// Handlers (jaxinfer/ops/cpu_matmul.py calls them):
//
//   JaxinferMatmulFloat x [M, K] f32, w f32, bf16 or f16: [K, N] (w_contract 0) or [N, K]
//                       (w_contract 1, a tied LM head stored [vocab, hidden]) -> y [M, N] f32.
//                       16-bit weights are widened exactly (bf16: a shift; f16: cvtph) and
//                       multiplied in float32: x is never rounded. Attr bf16_dot (bf16 w, a build
//                       and CPU with AMX): the products run on the AMX tiles with x rounded to
//                       bfloat16 (see "AMX" below).
//   JaxinferMatmulQ     x [M, K] f32, q, scale, offset -> y [M, N] f32, the weight being a
//                       jaxinfer.ops.quant.QuantizedWeight:
//                         bits 8: q int8 [K, N];  bits 4: q uint8 [K/2, N], row 2j in the
//                         low nibble of byte row j, row 2j+1 in the high one (u in 0..15);
//                         scale f16 [K/group, N]; offset f16 [K/group, N], or [0, N] for none.
//                       w[k, n] = scale[k/group, n] * v + offset[k/group, n], where v is the
//                       int8, or the nibble u (u - 8 when there is no offset).
//                       Attr w_contract 1: the transposed int8 layout (rows are outputs, as
//                       GGUF's blocks): q int8 [N, K], scale f16 [N, K/group], offset [0, N];
//                       w[n, k] = scale[n, k/group] * q[n, k], y[m, n] = sum_k x[m, k] w[n, k].
//                       Attr int8_dot (a build with AVX512-VNNI; groups and K multiples of 32): the
//                       products are VPDPBUSD integer dots of x quantized to int8 per row and block of
//                       32 (see "VNNI" below), for both layouts.
//
// ONE REDUCTION ORDER. Each output element y[m, n] is computed by the same sequence of
// float operations whatever the number of rows M, the row's position, the other rows, the
// tile sizes, the thread count and band split, and whichever of the two [K, N] paths below
// runs, so a row's result is bitwise the same alone or in any batch:
//
//   [K, N]: y = 0; for each block of kKBlock contraction rows (never straddling a scale
//     group; K itself for a float weight in blocks of kKBlock): acc = 0, then acc =
//     fma(x[k], w[k, n], acc) for k in order (w: the float value, the int8, or the nibble
//     u of row k, each exact in float32); then float: y = y + acc; quantized: y =
//     fma(scale, acc', y), with acc' = acc - 8 xsum at a group's last block (int4 without
//     offset) and, at a group's last block with an offset, y = fma(offset, xsum, y).
//     Columns past the last whole vector: a scalar loop of its own fixed order (tail_columns).
//   [N, K]: acc lanes over k in steps of the vector width, a fixed horizontal sum, then the
//     k past the last whole vector in order (int8: per group or per row scales as below).
//
// [K, N] layout, few rows (at most kMaxTile: decode). A work item is a band of output
// columns (at most 16 x 4 vectors; the bands split evenly over the threads). Rows of x are
// one tile, columns go in panels of NV vectors; for each block the tile's partial sums are
// MT x NV vector registers: each weight vector is loaded and converted once and multiplied
// into every row (x broadcast from its own rows). At the
// end of a block the sums go into y (in cache) as above. Each panel prefetches its next
// block. Columns past the last whole vector are done by a scalar loop. An int4 byte row j
// is converted to its low nibbles (row 2j) and high nibbles (row 2j + 1).
//
// [K, N] layout, more rows (prefill): per band and block, the block's weights over the
// band's whole vectors are converted once to float32 (int4: a row of each nibble)
// into a thread-local panel (kKBlock x band, in L2), then every tile of kGemmRows rows runs
// over it, panel of kGemmVecs vectors by panel (a panel's 2-4 KB stay in L1 across the
// tiles). Converting is exact, and the multiply-adds and the fold into y are the ones the
// few-row path does, in the same order: bitwise the same results.
//
// [N, K] layout (transposed: float32, bf16, f16 or int8): a work item is a band of weight
// rows (= output columns), a contiguous run of memory; tiles of MT x NT dot products along
// K, reduced at the end (int8: converted in registers, scaled per group or per row).
//
// Work items are shared with XLA's intra-op thread pool (as the attention kernel does):
// workers take items from an atomic counter, the calling thread works too and then waits
// for all items to be done.
//
// SIMD is chosen at compile time (the build uses -march=native): AVX-512 (16 lanes),
// AVX2 + FMA + F16C (8 lanes), or a scalar fallback (1 lane), all from the same templates.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The AMX path (bfloat16 weights): built where the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16
// (-march=native on such a CPU), used where the kernel grants this process the tile state.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__x86_64__)
#define JAXINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The VNNI path (int8 and int4 [K, N] weights): built where the compiler targets AVX512-VNNI (-march=native
// on such a CPU), used where the caller asks for it (attr int8_dot).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define JAXINFER_VNNI 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// scalar helpers

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24 (0 or subnormal)
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// a * b + c for the scalar loops (tails, odd groups): one rounding where the build has FMA
// (every SIMD build), two otherwise, spelled out so that the compiler cannot contract
// `c += a * b` in one template instance (one tile size) and not in another: that gave a
// row other bits alone than among others.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// bfloat16 is float32's upper half: widening is a shift.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// ---------------------------------------------------------------------------
// vector traits: F a vector of L floats

struct Scalar {
  static constexpr int L = 1;
  static constexpr int kBudget = 8;  // accumulators a tile may hold
  using F = float;
  static F zero() { return 0.f; }
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F load_i8(const int8_t* p) { return static_cast<float>(*p); }
  // A byte of two nibbles: `lo` = the low nibble, `hi` = the high one, as floats.
  static void load_u4(const uint8_t* p, F& lo, F& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
  static F load_h(const uint16_t* p) { return half_to_float(*p); }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static float h2f(uint16_t h) { return half_to_float(h); }
  static float sum(F v) { return v; }
};

#if defined(__AVX512F__)
struct Avx512 {
  static constexpr int L = 16;
  static constexpr int kBudget = 24;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void load_u4(const uint8_t* p, F& lo, F& hi) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    // vpermps reads the low 4 bits of each index: a table lookup gives the low nibble as a float
    lo = _mm512_permutexvar_ps(u, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4));
  }
  static F load_h(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_bf16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
using Vec = Avx512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Avx2 {
  static constexpr int L = 8;
  static constexpr int kBudget = 12;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void load_u4(const uint8_t* p, F& lo, F& hi) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
  }
  static F load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
using Vec = Avx2;
#else
using Vec = Scalar;
#endif

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

constexpr int kMaxTile = Vec::L == 16 ? 16 : (Vec::L == 8 ? 12 : 8);  // rows of x per tile (few-row path)
// The many-row path's register tile: kGemmRows rows of x by kGemmVecs vectors of columns
// (accumulators + the panel's weight vectors + one broadcast fit the register file; loads
// per multiply-add: AVX-512 10 / 24, AVX2 8 / 12).
constexpr int kGemmRows = Vec::L == 1 ? 4 : 6;
constexpr int kGemmVecs = Vec::L == 16 ? 4 : 2;
// Contraction rows per block (a multiple of 2). Prefetching the next block of a panel while
// this one is summed gives the quantized panels (one cache line or less a row) memory-level
// parallelism that the hardware prefetchers do not: measured single-threaded on cold int8 /
// int4 weights, 2-3x the GB/s of no prefetching; float32 rows (4 lines a panel) stream well
// without it at one row of x, and take it from 2 rows on. The block is also the unit of
// the reduction order (see the top of the file): changing it changes every result's bits.
constexpr int kKBlock = 32;
constexpr int kPrefetchRows = 32;
constexpr int64_t kMaxBandUnits = 16;  // a work item's columns, at most, in units of 4 vectors
// ... at most kFewRows rows of x ([K, N]): twice as wide. Longer runs of each weight row stream better when
// the weights are read once (measured, the chained SmolLM2 products at one row, cold: float32 ~5%, bfloat16
// ~10% faster); with more rows the wider panels leave L1 (128 rows: 5-15% slower).
constexpr int64_t kFewRows = 4;

// A hint only: an address past the weight's end (the last block's lookahead) is harmless.
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// How many vectors wide a panel is for a tile of MT rows: as many as fit the register budget, <= 4.
constexpr int panel_vectors(int mt) {
  return 4 * mt <= Vec::kBudget ? 4 : (2 * mt <= Vec::kBudget ? 2 : 1);
}

// ---------------------------------------------------------------------------
// the problem

enum Kind { kF32 = 0, kI8 = 1, kU4 = 2, kBF16 = 3, kF16 = 4 };
enum OffsetMode { kNoOffset = 0, kOffset = 1, kMinus8 = 2 };  // kMinus8: int4 without offset, v = u - 8

constexpr bool is_float(int kind) { return kind == kF32 || kind == kBF16 || kind == kF16; }
constexpr int elem_bytes(int kind) { return kind == kF32 ? 4 : (kind == kBF16 || kind == kF16 ? 2 : 1); }

// One weight element, widened to float32 (exactly; int4 is not an element: see tail_columns).
template <int KIND>
inline float w_at(const void* w, int64_t i) {
  if constexpr (KIND == kF32)
    return static_cast<const float*>(w)[i];
  else if constexpr (KIND == kI8)
    return static_cast<const int8_t*>(w)[i];
  else if constexpr (KIND == kBF16)
    return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
  else
    return half_to_float(static_cast<const uint16_t*>(w)[i]);
}

// L weight elements from element i on, widened to float32 in registers.
template <class V, int KIND>
inline typename V::F load_w(const void* w, int64_t i) {
  if constexpr (KIND == kF32)
    return V::load(static_cast<const float*>(w) + i);
  else if constexpr (KIND == kI8)
    return V::load_i8(static_cast<const int8_t*>(w) + i);
  else if constexpr (KIND == kBF16)
    return V::load_bf16(static_cast<const uint16_t*>(w) + i);
  else
    return V::load_h(static_cast<const uint16_t*>(w) + i);
}

struct Problem {
  const float* x = nullptr;  // [M, K]: a tile's rows are broadcast from their own rows (no repacked copy)
  const void* w = nullptr;   // f32 / bf16 / f16 [K, N] or [N, K], int8 [K, N] or [N, K], uint8 [K/2, N]
  const uint16_t* scale = nullptr;   // [G, N] f16
  const uint16_t* offset = nullptr;  // [G, N] f16 or null
  const float* xsum = nullptr;       // [M, G]: sums of x over each group (offset modes only)
  float* y = nullptr;                // [M, N]
  int64_t m = 0, k = 0, n = 0;
  int64_t group = 0;  // contraction rows per scale (K for float)
  int64_t groups = 1;
  int64_t band = 0;   // columns (rows of a transposed w) per work item
  int64_t items = 0;
  int kind = kF32;
  int offset_mode = kNoOffset;
  bool transposed = false;
  bool blocked = false;  // [K, N]: the many-row path
  // The AMX path (bfloat16 weights, `amx`): x rounded to bfloat16, rows to a multiple of 16 (mp), K to
  // one of 32 or 16 (kp), zeros past x, as the layout's operands (see amx::pack).
  bool amx = false;
  // The VNNI path (quantized [K, N] weights, `dot8`): x quantized to int8 per row and block of 32
  // (xq [M, K], its scales xsc [M, K/32] and integer sums xqs [M, K/32]; see vnni::quantize_x).
  bool dot8 = false;
  const int8_t* xq = nullptr;
  const float* xsc = nullptr;
  const int32_t* xqs = nullptr;
  const int32_t* xcorr = nullptr;  // [N, K] int8: per row of x and 4 contraction values (vnni::lane_prep)
  const float* xlane = nullptr;
  const uint16_t* xb = nullptr;
  const uint16_t* xo = nullptr;
  const uint32_t* xpairs = nullptr;
  int64_t mp = 0, kp = 0;
};

// ---------------------------------------------------------------------------
// [K, N] layout: the end of a block. acc[i][v] holds rows m0 + i, columns n + v L, summed
// over one block of group g; adds it into y (float: y + acc; quantized: scale * acc + y),
// and the group's offset term when `last`. Both [K, N] paths end their blocks here.

template <class V, int MT, int NV, int KIND, int OFF>
inline void fold(const Problem& p, typename V::F (&acc)[MT][NV], int64_t m0, int64_t n, int64_t g, bool last) {
  using F = typename V::F;
  constexpr int L = V::L;
  const int64_t N = p.n;
  float* y = p.y + m0 * N + n;
  if constexpr (is_float(KIND)) {
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) V::store(y + i * N + v * L, V::add(V::load(y + i * N + v * L), acc[i][v]));
  } else {
    F s[NV], o[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      s[v] = V::load_h(p.scale + g * N + n + v * L);
      if constexpr (OFF == kOffset) o[v] = V::load_h(p.offset + g * N + n + v * L);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const float xs = OFF != kNoOffset && last ? p.xsum[(m0 + i) * p.groups + g] : 0.f;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        F a = acc[i][v];
        if constexpr (OFF == kMinus8) {
          if (last) a = V::add(a, V::set1(-8.f * xs));
        }
        F out = V::fma(s[v], a, V::load(y + i * N + v * L));
        if constexpr (OFF == kOffset) {
          if (last) out = V::fma(o[v], V::set1(xs), out);
        }
        V::store(y + i * N + v * L, out);
      }
    }
  }
}

// [K, N], few rows: one panel (MT rows of x, NV vectors of columns at n) over rows [k0, k1)
// of one group g, reading and widening the weights in registers.

template <class V, int MT, int NV, int KIND, int OFF>
inline void panel(const Problem& p, int64_t m0, int64_t n, int64_t k0, int64_t k1, int64_t g, bool last) {
  using F = typename V::F;
  constexpr int L = V::L;
  const int64_t N = p.n, K = p.k;
  const float* x = p.x + m0 * K;  // row i's x[k] at x[i * K + k]
  F acc[MT][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();

  if constexpr (KIND != kU4) {
    // One row streams well on the hardware prefetchers alone (float32 rows are 4 lines a panel).
    const bool pf = KIND != kF32 || p.m > 1;
    constexpr int kBytes = elem_bytes(KIND);
    for (int64_t k = k0; k < k1; ++k) {
      F wv[NV];
      if (KIND != kF32 || pf)
#pragma GCC unroll 4
        for (int line = 0; line < NV * L * kBytes; line += 64)
          prefetch(static_cast<const char*>(p.w) + ((k + kPrefetchRows) * N + n) * kBytes + line);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) wv[v] = load_w<V, KIND>(p.w, k * N + n + v * L);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const F xb = V::set1(x[i * K + k]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(xb, wv[v], acc[i][v]);
      }
    }
  } else {  // kU4: byte row j holds rows 2j (low nibble) and 2j + 1 (high nibble), summed in order
    const uint8_t* q = static_cast<const uint8_t*>(p.w);
    for (int64_t j = k0 / 2; j < k1 / 2; ++j) {
      F lo[NV], hi[NV];
#pragma GCC unroll 4
      for (int line = 0; line < NV * L; line += 64) prefetch(q + (j + kPrefetchRows / 2) * N + n + line);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) V::load_u4(q + j * N + n + v * L, lo[v], hi[v]);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) {
        const F a = V::set1(x[i * K + 2 * j]);      // x[2j]
        const F b = V::set1(x[i * K + 2 * j + 1]);  // x[2j + 1]
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(b, hi[v], V::fma(a, lo[v], acc[i][v]));
      }
    }
  }
  fold<V, MT, NV, KIND, OFF>(p, acc, m0, n, g, last);
}

// Scalar, for the columns [n0, n1) past the last whole vector: rows [m0, m0 + mt), all of K.
// Its order (per group: a sequential sum of x * w, then scaled into the total) is its own,
// fixed, the same for any rows.
template <int KIND, int OFF>
void tail_columns(const Problem& p, int64_t m0, int64_t mt, int64_t n0, int64_t n1) {
  const int64_t N = p.n, K = p.k;
  for (int64_t i = m0; i < m0 + mt; ++i) {
    const float* x = p.x + i * K;
    for (int64_t n = n0; n < n1; ++n) {
      float total = 0.f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float acc = 0.f;
        for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
          float v;
          if constexpr (KIND == kU4) {
            const uint8_t b = static_cast<const uint8_t*>(p.w)[(k / 2) * N + n];
            v = (k & 1) ? (b >> 4) : (b & 15);
          } else {
            v = w_at<KIND>(p.w, k * N + n);
          }
          acc = madd(x[k], v, acc);
        }
        if constexpr (is_float(KIND)) {
          total += acc;
        } else {
          const float xs = OFF != kNoOffset ? p.xsum[i * p.groups + g] : 0.f;
          if constexpr (OFF == kMinus8) acc += -8.f * xs;  // exact: a power of two
          total = madd(half_to_float(p.scale[g * N + n]), acc, total);
          if constexpr (OFF == kOffset) total = madd(half_to_float(p.offset[g * N + n]), xs, total);
        }
      }
      p.y[i * N + n] = total;
    }
  }
}

// One tile of MT rows over the band's columns [c0, c1), all of K.
template <int MT, int KIND, int OFF>
void tile_kn(const Problem& p, int64_t m0, int64_t c0, int64_t c1) {
  using V = Vec;
  constexpr int L = V::L;
  constexpr int NV = panel_vectors(MT);
  const int64_t N = p.n;
  for (int i = 0; i < MT; ++i) std::fill(p.y + (m0 + i) * N + c0, p.y + (m0 + i) * N + c1, 0.f);
  const int64_t vec_end = c0 + (c1 - c0) / L * L;  // columns in whole vectors
  const int64_t wide_end = c0 + (vec_end - c0) / (NV * L) * (NV * L);
  const int64_t block = std::min<int64_t>(kKBlock, p.group);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t g0 = g * p.group, g1 = g0 + p.group;
    for (int64_t k0 = g0; k0 < g1; k0 += block) {
      const int64_t k1 = std::min(g1, k0 + block);
      const bool last = k1 == g1;
      for (int64_t n = c0; n < wide_end; n += NV * L) panel<V, MT, NV, KIND, OFF>(p, m0, n, k0, k1, g, last);
      for (int64_t n = wide_end; n < vec_end; n += L) panel<V, MT, 1, KIND, OFF>(p, m0, n, k0, k1, g, last);
    }
  }
  if (vec_end < c1) tail_columns<KIND, OFF>(p, m0, MT, vec_end, c1);
}

template <int KIND, int OFF, int MT = kMaxTile>
void tile_dispatch(const Problem& p, int64_t m0, int mt, int64_t c0, int64_t c1) {
  if constexpr (MT >= 1) {
    if (mt == MT)
      tile_kn<MT, KIND, OFF>(p, m0, c0, c1);
    else
      tile_dispatch<KIND, OFF, MT - 1>(p, m0, mt, c0, c1);
  }
}

// ---------------------------------------------------------------------------
// [K, N], many rows: per block, the band's weights converted once into a float32 panel
// (`wb`, row stride `ws`; int4: byte row j gives rows 2j and 2j + 1, its low and high
// nibbles), then every row tile over it with the few-row path's multiply-adds and fold.

float* scratch(size_t floats) {
  static thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

template <class V, int MT, int NV, int KIND, int OFF>
inline void micro(const Problem& p, const float* wb, int64_t ws, int64_t m0, int64_t n, int64_t k0, int64_t k1,
                  int64_t g, bool last) {
  using F = typename V::F;
  constexpr int L = V::L;
  const int64_t K = p.k;
  const float* x = p.x + m0 * K;
  F acc[MT][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
  for (int64_t k = k0; k < k1; ++k, wb += ws) {
    F wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = V::load(wb + v * L);
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const F xb = V::set1(x[i * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(xb, wv[v], acc[i][v]);
    }
  }
  fold<V, MT, NV, KIND, OFF>(p, acc, m0, n, g, last);
}

template <int NV, int KIND, int OFF, int MT = kGemmRows - 1>
void micro_rest(const Problem& p, int mt, const float* wb, int64_t ws, int64_t m0, int64_t n, int64_t k0, int64_t k1,
                int64_t g, bool last) {
  if constexpr (MT >= 1) {
    if (mt == MT)
      micro<Vec, MT, NV, KIND, OFF>(p, wb, ws, m0, n, k0, k1, g, last);
    else
      micro_rest<NV, KIND, OFF, MT - 1>(p, mt, wb, ws, m0, n, k0, k1, g, last);
  }
}

// Every row of x over one panel of NV vectors (columns n...) of a converted block.
template <int NV, int KIND, int OFF>
void all_rows(const Problem& p, const float* wb, int64_t ws, int64_t n, int64_t k0, int64_t k1, int64_t g,
              bool last) {
  int64_t m0 = 0;
  for (; m0 + kGemmRows <= p.m; m0 += kGemmRows)
    micro<Vec, kGemmRows, NV, KIND, OFF>(p, wb, ws, m0, n, k0, k1, g, last);
  if (m0 < p.m) micro_rest<NV, KIND, OFF>(p, static_cast<int>(p.m - m0), wb, ws, m0, n, k0, k1, g, last);
}

// Rows [k0, k1) of w over columns [c0, c0 + W) (whole vectors) into buf, float32, row stride ws (>= W).
template <int KIND>
void convert_block(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t W, int64_t ws, float* buf) {
  using V = Vec;
  constexpr int L = V::L;
  const int64_t N = p.n;
  if constexpr (KIND == kU4) {
    const uint8_t* q = static_cast<const uint8_t*>(p.w);
    for (int64_t j = k0 / 2; j < k1 / 2; ++j) {
      const uint8_t* row = q + j * N + c0;
      float* lo = buf + (2 * j - k0) * ws;  // rows 2j and 2j + 1 of the block
      for (int64_t c = 0; c < W; c += L) {
        if ((c & 63) < L) prefetch(row + kPrefetchRows / 2 * N + c);
        typename V::F l, h;
        V::load_u4(row + c, l, h);
        V::store(lo + c, l);
        V::store(lo + ws + c, h);
      }
    }
  } else {
    constexpr int64_t kBytes = elem_bytes(KIND);
    const char* base = static_cast<const char*>(p.w);
    for (int64_t k = k0; k < k1; ++k) {
      float* dst = buf + (k - k0) * ws;
      for (int64_t c = 0; c < W; c += L) {
        if (((c * kBytes) & 63) < L * kBytes) prefetch(base + ((k + kPrefetchRows) * N + c0 + c) * kBytes);
        V::store(dst + c, load_w<V, KIND>(p.w, k * N + c0 + c));
      }
    }
  }
}

template <int KIND, int OFF>
void item_kn_blocked(const Problem& p, int64_t c0, int64_t c1) {
  constexpr int L = Vec::L;
  constexpr int NV = kGemmVecs;
  const int64_t N = p.n;
  const int64_t vec_end = c0 + (c1 - c0) / L * L, W = vec_end - c0;
  if (W > 0) {
    for (int64_t i = 0; i < p.m; ++i) std::fill(p.y + i * N + c0, p.y + i * N + vec_end, 0.f);
    // The panel's rows one vector further apart than W: a row stride of a multiple of 4 KB (a band of
    // 1024 float32 columns) put every row of a micro-tile's panel in the same L1 sets (measured on one
    // core, 128 rows x [576, 3072]: float32 87 -> 102 GFLOP/s, int8 92 -> 108). Addresses only: the
    // sums are the same. (A 64-row block would give another ~12% here, but it changes every result's
    // bits and made int8 batch-1 decode ~15% slower: its panels revisit a weight row half as soon.)
    const int64_t ws = W + L;
    float* buf = scratch(static_cast<size_t>(kKBlock * ws));
    const int64_t wide = W / (NV * L) * (NV * L);
    const int64_t block = std::min<int64_t>(kKBlock, p.group);
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t g0 = g * p.group, g1 = g0 + p.group;
      for (int64_t k0 = g0; k0 < g1; k0 += block) {
        const int64_t k1 = std::min(g1, k0 + block);
        const bool last = k1 == g1;
        convert_block<KIND>(p, k0, k1, c0, W, ws, buf);
        for (int64_t c = 0; c < wide; c += NV * L) all_rows<NV, KIND, OFF>(p, buf + c, ws, c0 + c, k0, k1, g, last);
        for (int64_t c = wide; c < W; c += L) all_rows<1, KIND, OFF>(p, buf + c, ws, c0 + c, k0, k1, g, last);
      }
    }
  }
  if (vec_end < c1) tail_columns<KIND, OFF>(p, 0, p.m, vec_end, c1);
}

template <int KIND, int OFF>
void item_kn(const Problem& p, int64_t item) {
  const int64_t c0 = item * p.band, c1 = std::min(p.n, c0 + p.band);
  if (p.blocked) return item_kn_blocked<KIND, OFF>(p, c0, c1);
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxTile) {
    const int mt = static_cast<int>(std::min<int64_t>(kMaxTile, p.m - m0));
    tile_dispatch<KIND, OFF>(p, m0, mt, c0, c1);
  }
}

// ---------------------------------------------------------------------------
// [N, K] layout (float32, bf16, f16): y[m, n] = sum_k x[m, k] w[n, k]

// How far ahead each weight row of a transposed tile prefetches (bytes; 0: no software prefetch). The
// rows are contiguous, so that is the next panels' bytes; see the int8 [N, K] path below for the figures.
#ifndef JAXINFER_PREFETCH_T
#define JAXINFER_PREFETCH_T 8192
#endif
constexpr int64_t kPrefetchT = JAXINFER_PREFETCH_T;

// A transposed tile: kTileT rows of x by kRowsT weight rows, kTileT * kRowsT accumulators
// (measured on AVX-512, 1 to 16 rows: 4 x 6 beats 2 x 8, 3 x 8 and 4 x 4).
constexpr int kTileT = Vec::L == 16 ? 4 : 2;
constexpr int kRowsT = Vec::L == 16 ? 6 : 4;

template <int MT, int NT, int KIND>
inline void panel_t(const Problem& p, int64_t m0, int64_t n0) {
  using V = Vec;
  using F = V::F;
  constexpr int L = V::L;
  const int64_t K = p.k;
  const float* x = p.x + m0 * K;
  const int64_t w0 = n0 * K;  // element offset of weight row n0
  F acc[MT][NT];
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[i][t] = V::zero();
  constexpr int64_t kBytes = elem_bytes(KIND);
  const char* wbytes = static_cast<const char*>(p.w);
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if (kPrefetchT > 0 && ((k * kBytes) & 63) < L * kBytes)  // one line per 64 bytes of each row
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) prefetch(wbytes + (w0 + t * K + k) * kBytes + kPrefetchT);
    F xv[MT];
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) xv[i] = V::load(x + i * K + k);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const F wv = load_w<V, KIND>(p.w, w0 + t * K + k);
#pragma GCC unroll 16
      for (int i = 0; i < MT; ++i) acc[i][t] = V::fma(xv[i], wv, acc[i][t]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int t = 0; t < NT; ++t) {
      float r = V::sum(acc[i][t]);
      for (int64_t kk = k; kk < K; ++kk) r = madd(x[i * K + kk], w_at<KIND>(p.w, w0 + t * K + kk), r);
      p.y[(m0 + i) * p.n + n0 + t] = r;
    }
}

template <int MT, int KIND>
void tile_t(const Problem& p, int64_t m0, int64_t r0, int64_t r1) {
  constexpr int NT = kRowsT;
  int64_t r = r0;
  for (; r + NT <= r1; r += NT) panel_t<MT, NT, KIND>(p, m0, r);
  for (; r < r1; ++r) panel_t<MT, 1, KIND>(p, m0, r);
}

template <int KIND>
void item_t(const Problem& p, int64_t item) {
  const int64_t r0 = item * p.band, r1 = std::min(p.n, r0 + p.band);
  for (int64_t m0 = 0; m0 < p.m; m0 += kTileT) {
    const int64_t mt = std::min<int64_t>(kTileT, p.m - m0);
    if (mt == 1)
      tile_t<1, KIND>(p, m0, r0, r1);
    else if (mt == 2 || kTileT == 2)
      tile_t<2, KIND>(p, m0, r0, r1);
    else if (mt == 3)
      tile_t<3, KIND>(p, m0, r0, r1);
    else
      tile_t<kTileT, KIND>(p, m0, r0, r1);
  }
}

// ---------------------------------------------------------------------------
// [N, K] layout, int8 (w_contract 1): y[m, n] = sum_g scale[n, g] sum_{k in g} x[m, k] q[n, k]
//
// A band of weight rows is one contiguous run of memory, read front to back. Tiles are
// kTileT rows of x by kRowsT weight rows, as for float32. Per-row scales (one group) are
// applied to the reduced sums; smaller groups scale each converted weight vector (one
// multiply per vector, shared by the tile's rows of x). Groups that are not a multiple of
// the vector width take a scalar loop. Each weight row prefetches kPrefetchT bytes ahead,
// one line per 64 bytes (rows are contiguous, so that is the next panels' bytes): measured
// single-threaded at M = 1 on the cold [49152, 576] head (AVX-512), 6.3 GB/s without,
// 8.1 at 2 KB, ~9.5-10 from 4 to 16 KB (flat; an L2 hint instead of L1 made no difference).

enum QtMode { kQtRow = 0, kQtGroup = 1, kQtScalar = 2 };

template <int MT, int NT, int MODE>
inline void panel_qt(const Problem& p, int64_t m0, int64_t n0) {
  using V = Vec;
  using F = V::F;
  constexpr int L = V::L;
  const int64_t K = p.k, G = p.groups;
  const float* x = p.x + m0 * K;
  const int8_t* w = static_cast<const int8_t*>(p.w) + n0 * K;
  const uint16_t* sc = p.scale + n0 * G;
  if constexpr (MODE == kQtScalar) {
    for (int i = 0; i < MT; ++i)
      for (int t = 0; t < NT; ++t) {
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float acc = 0.f;
          for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) acc = madd(x[i * K + k], w[t * K + k], acc);
          total = madd(V::h2f(sc[t * G + g]), acc, total);
        }
        p.y[(m0 + i) * p.n + n0 + t] = total;
      }
    return;
  } else {
    F acc[MT][NT];
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[i][t] = V::zero();
    int64_t k = 0;
    if constexpr (MODE == kQtRow) {
      for (; k + L <= K; k += L) {
        if (kPrefetchT > 0 && (k & 63) < L)
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t) prefetch(w + t * K + k + kPrefetchT);
        F xv[MT];
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) xv[i] = V::load(x + i * K + k);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          const F wv = V::load_i8(w + t * K + k);
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) acc[i][t] = V::fma(xv[i], wv, acc[i][t]);
        }
      }
    } else {  // kQtGroup: group % L == 0, so K % L == 0
      for (int64_t g = 0; g < G; ++g) {
        F sv[NT];
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) sv[t] = V::set1(V::h2f(sc[t * G + g]));
        for (const int64_t k1 = k + p.group; k < k1; k += L) {
          if (kPrefetchT > 0 && (k & 63) < L)
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) prefetch(w + t * K + k + kPrefetchT);
          F xv[MT];
#pragma GCC unroll 16
          for (int i = 0; i < MT; ++i) xv[i] = V::load(x + i * K + k);
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t) {
            const F wv = V::mul(V::load_i8(w + t * K + k), sv[t]);
#pragma GCC unroll 16
            for (int i = 0; i < MT; ++i) acc[i][t] = V::fma(xv[i], wv, acc[i][t]);
          }
        }
      }
    }
    for (int i = 0; i < MT; ++i)
      for (int t = 0; t < NT; ++t) {
        float r = V::sum(acc[i][t]);
        if constexpr (MODE == kQtRow) {
          for (int64_t kk = k; kk < K; ++kk) r = madd(x[i * K + kk], w[t * K + kk], r);
          r *= V::h2f(sc[t]);
        }
        p.y[(m0 + i) * p.n + n0 + t] = r;
      }
  }
}

template <int MT, int MODE>
void tile_qt(const Problem& p, int64_t m0, int64_t r0, int64_t r1) {
  constexpr int NT = kRowsT;
  int64_t r = r0;
  for (; r + NT <= r1; r += NT) panel_qt<MT, NT, MODE>(p, m0, r);
  for (; r < r1; ++r) panel_qt<MT, 1, MODE>(p, m0, r);
}

template <int MODE>
void item_qt_mode(const Problem& p, int64_t r0, int64_t r1) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kTileT) {
    const int64_t mt = std::min<int64_t>(kTileT, p.m - m0);
    if (mt == 1)
      tile_qt<1, MODE>(p, m0, r0, r1);
    else if (mt == 2 || kTileT == 2)
      tile_qt<2, MODE>(p, m0, r0, r1);
    else if (mt == 3)
      tile_qt<3, MODE>(p, m0, r0, r1);
    else
      tile_qt<kTileT, MODE>(p, m0, r0, r1);
  }
}

void item_qt(const Problem& p, int64_t item) {
  const int64_t r0 = item * p.band, r1 = std::min(p.n, r0 + p.band);
  if (p.groups == 1)
    item_qt_mode<kQtRow>(p, r0, r1);
  else if (p.group % Vec::L == 0)
    item_qt_mode<kQtGroup>(p, r0, r1);
  else
    item_qt_mode<kQtScalar>(p, r0, r1);
}

// ---------------------------------------------------------------------------
// VNNI, int8 and int4 [K, N] weights: integer products of x quantized per block
//
// Where the build has AVX512-VNNI and the caller asks for it (attr int8_dot), a quantized [K, N]
// weight (int8, or int4 with or without an offset; groups a multiple of kQ) is multiplied by
// VPDPBUSD, 64 multiply-adds an instruction, as llama.cpp's Q8_0 / Q4_1 dots and oneDNN's int8
// products do. x is quantized per row and block of kQ = 32 contraction values:
//
//   xs = max |x[k]| / 127 over the block, xq[k] = round_to_nearest_even(x[k] * (127 / max)), in
//   [-127, 127] (a block of zeros: xs = 0, xq = 0);
//
// then, per output element and block b of group g, in order:
//
//   acc = sum over the block's k of xq[k] * v[k, n]   (int32, exact: at most 32 * 127 * 128)
//   y = fma(scale[g, n] * xs, float(acc), y)         (y starts at 0; float(acc) is exact)
//   and at a group's last block with an offset: y = fma(offset[g, n], xsum_g, y)
//
// where v is the int8, u - 8 (int4 without offset) or the nibble u (with one), and xsum_g the sum of
// x as quantized over the group (quantized_sums). An integer sum has one value whatever order its terms
// are added in, so every path that computes it (the vector blocks, the scalar columns past the last
// 64, any rows, threads or bands) gives a row bitwise the same result alone or in any batch; the
// float steps are the same operations in the same order everywhere.
//
// The weight goes through VPDPBUSD as its unsigned operand (int8 v + 128, the bias taken out by
// starting acc at -128 * sum(xq); a nibble as it is, with -8 * sum(xq) for u - 8), xq as the signed
// one, broadcast 4 bytes (4 contraction rows) at a time. Per band and block of 32 rows the weights
// are interleaved once into a thread-local panel (for each 4 rows, each column's 4 bytes together,
// columns in order), then every tile of up to kDotRows rows of x runs over it, 64 columns at a time.

#ifdef JAXINFER_VNNI
namespace vnni {

constexpr int kQ = 32;        // x's quantization block, and the block of the fold above
constexpr int kDotRows = 6;   // rows of x per tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int kDirectRows = 4;  // at most this many rows: the weights interleaved in registers, no panel

inline int32_t load_u32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// x [M, K] -> xq int8 [M, K], xs [M, K/kQ] and the sums of xq per block [M, K/kQ] (see above).
void quantize_x(Problem& p, std::vector<int8_t>& xq, std::vector<float>& xs, std::vector<int32_t>& qs) {
  const int64_t M = p.m, K = p.k, B = K / kQ;
  xq.resize(static_cast<size_t>(M * K));
  xs.resize(static_cast<size_t>(M * B));
  qs.resize(static_cast<size_t>(M * B));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* x = p.x + m * K + b * kQ;
      const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
      constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a0, inv), kRound);
      __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a1, inv), kRound);
      q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
      q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
      int8_t* dst = xq.data() + m * K + b * kQ;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
      xs[m * B + b] = mx > 0.f ? mx / 127.f : 0.f;
      qs[m * B + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  p.xq = xq.data();
  p.xsc = xs.data();
  p.xqs = qs.data();
}

// With an offset: the group sums of x as quantized (xsum_g = sum over the group's blocks, in order, of
// xs * sum(xq)), so that the offset's term and the integer one multiply the same x.
void quantized_sums(Problem& p, std::vector<float>& xsum) {
  const int64_t B = p.k / kQ, per = p.group / kQ;
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t g = 0; g < p.groups; ++g) {
      float s = 0.f;
      for (int64_t b = g * per; b < (g + 1) * per; ++b) s += p.xsc[i * B + b] * static_cast<float>(p.xqs[i * B + b]);
      xsum[i * p.groups + g] = s;
    }
}

// Four rows of 64 unsigned bytes (columns c .. c + 63) -> out[v] with dword j = the 4 rows' bytes of
// column c + 16 v + j. Each row's dwords are first permuted (dword 4 L + j <- dword L + 4 j) so that
// the in-lane unpacks leave the columns in order.
inline void interleave4(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i* out) {
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  r0 = _mm512_permutexvar_epi32(idx, r0);
  r1 = _mm512_permutexvar_epi32(idx, r1);
  r2 = _mm512_permutexvar_epi32(idx, r2);
  r3 = _mm512_permutexvar_epi32(idx, r3);
  const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
  const __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
  out[0] = _mm512_unpacklo_epi16(t0, t2);
  out[1] = _mm512_unpackhi_epi16(t0, t2);
  out[2] = _mm512_unpacklo_epi16(t1, t3);
  out[3] = _mm512_unpackhi_epi16(t1, t3);
}

// Contraction rows [k, k + 4) over columns [c, c + 64), interleaved (interleave4) as VPDPBUSD's unsigned
// operand: int8 v + 128, or the nibbles; prefetches the rows kPrefetchRows further on.
template <int KIND>
inline void quad(const Problem& p, int64_t k, int64_t c, __m512i* out) {
  const int64_t N = p.n;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  if constexpr (KIND == kI8) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* src = w + k * N + c;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) prefetch(src + (kPrefetchRows + i) * N);  // the 4 rows a block further on
    __m512i rows[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) rows[i] = _mm512_xor_si512(_mm512_loadu_si512(src + i * N), bias);  // v + 128
    interleave4(rows[0], rows[1], rows[2], rows[3], out);
  } else {  // kU4: byte row j holds rows 2j (low nibble) and 2j + 1 (high)
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const uint8_t* src = w + (k / 2) * N + c;
    prefetch(src + kPrefetchRows / 2 * N);  // the 2 byte rows a block further on
    prefetch(src + (kPrefetchRows / 2 + 1) * N);
    const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + N);
    interleave4(_mm512_and_si512(a, nib), _mm512_and_si512(_mm512_srli_epi16(a, 4), nib), _mm512_and_si512(b, nib),
                _mm512_and_si512(_mm512_srli_epi16(b, 4), nib), out);
  }
}

// Contraction rows [k0, k0 + kQ) over columns [c0, c0 + W) (W a multiple of 64) into the panel:
// 4-row group r at buf + r * qs, column c's 4 bytes at + 4 c.
template <int KIND>
void interleave_block(const Problem& p, int64_t k0, int64_t c0, int64_t W, int64_t qs, uint8_t* buf) {
  for (int64_t r = 0; r < kQ / 4; ++r)
    for (int64_t c = 0; c < W; c += 64) {
      __m512i out[4];
      quad<KIND>(p, k0 + 4 * r, c0 + c, out);
      for (int v = 0; v < 4; ++v) _mm512_storeu_si512(buf + r * qs + 4 * c + 64 * v, out[v]);
    }
}

// The integer sum's start for row m, block b: the int8 weight's +128 bias, int4's -8, or 0.
template <int KIND, int OFF>
inline int32_t acc_start(const Problem& p, int64_t m, int64_t b) {
  const int32_t s = p.xqs[m * (p.k / kQ) + b];
  return KIND == kI8 ? -128 * s : (OFF == kMinus8 ? -8 * s : 0);
}

// MT rows of x (from m0) over 64 columns (n) of the block at k0 of group g: the weights from the panel
// (`wb`, 4-row groups qs bytes apart), or (DIRECT, few rows) interleaved in registers as they are read.
template <int MT, int KIND, int OFF, bool DIRECT = false>
inline void dot_tile(const Problem& p, const uint8_t* wb, int64_t qs, int64_t m0, int64_t n, int64_t k0, int64_t g,
                     bool last) {
  const int64_t K = p.k, N = p.n, B = K / kQ, b = k0 / kQ;
  __m512i acc[MT][4];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    const __m512i a = _mm512_set1_epi32(acc_start<KIND, OFF>(p, m0 + i, b));
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[i][v] = a;
  }
  const int8_t* x = p.xq + m0 * K + k0;
#pragma GCC unroll 8
  for (int r = 0; r < kQ / 4; ++r, wb += qs) {
    __m512i wv[4];
    if constexpr (DIRECT) {
      quad<KIND>(p, k0 + 4 * r, n, wv);
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(wb + 64 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512i xb = _mm512_set1_epi32(load_u32(x + i * K + 4 * r));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], wv[v], xb);
    }
  }
  __m512 s[4], o[4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    s[v] = Avx512::load_h(p.scale + g * N + n + 16 * v);
    if constexpr (OFF == kOffset) o[v] = Avx512::load_h(p.offset + g * N + n + 16 * v);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    const __m512 xs = _mm512_set1_ps(p.xsc[(m0 + i) * B + b]);
    float* y = p.y + (m0 + i) * N + n;
    __m512 xsum = _mm512_setzero_ps();
    if constexpr (OFF == kOffset) {
      if (last) xsum = _mm512_set1_ps(p.xsum[(m0 + i) * p.groups + g]);
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m512 out = _mm512_fmadd_ps(_mm512_mul_ps(s[v], xs), _mm512_cvtepi32_ps(acc[i][v]), _mm512_loadu_ps(y + 16 * v));
      if constexpr (OFF == kOffset) {
        if (last) out = _mm512_fmadd_ps(o[v], xsum, out);
      }
      _mm512_storeu_ps(y + 16 * v, out);
    }
  }
}

template <int KIND, int OFF, int MT = kDotRows - 1>
void dot_rest(const Problem& p, int mt, const uint8_t* wb, int64_t qs, int64_t m0, int64_t n, int64_t k0, int64_t g,
                bool last) {
  if constexpr (MT >= 1) {
    if (mt == MT)
      dot_tile<MT, KIND, OFF>(p, wb, qs, m0, n, k0, g, last);
    else
      dot_rest<KIND, OFF, MT - 1>(p, mt, wb, qs, m0, n, k0, g, last);
  }
}

template <int KIND, int OFF, int MT = kDirectRows>
void direct_rows(const Problem& p, int mt, int64_t n, int64_t k0, int64_t g, bool last) {
  if constexpr (MT >= 1) {
    if (mt == MT)
      dot_tile<MT, KIND, OFF, true>(p, nullptr, 0, 0, n, k0, g, last);
    else
      direct_rows<KIND, OFF, MT - 1>(p, mt, n, k0, g, last);
  }
}

// Columns [n0, n1) past the last 64 of a band, every row: the same integer sums and float steps, scalar.
template <int KIND, int OFF>
void dot_tail_columns(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t N = p.n, K = p.k, B = K / kQ;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  for (int64_t i = 0; i < p.m; ++i) {
    const int8_t* x = p.xq + i * K;
    for (int64_t n = n0; n < n1; ++n) {
      float y = 0.f;
      for (int64_t g = 0; g < p.groups; ++g)
        for (int64_t k0 = g * p.group; k0 < (g + 1) * p.group; k0 += kQ) {
          int32_t acc = 0;
          for (int64_t k = k0; k < k0 + kQ; ++k) {
            int32_t v;
            if constexpr (KIND == kI8) {
              v = static_cast<int8_t>(w[k * N + n]);
            } else {
              const uint8_t byte = w[(k / 2) * N + n];
              v = (k & 1) ? (byte >> 4) : (byte & 15);
              if constexpr (OFF == kMinus8) v -= 8;
            }
            acc += static_cast<int32_t>(x[k]) * v;
          }
          const float sx = half_to_float(p.scale[g * N + n]) * p.xsc[i * B + k0 / kQ];
          y = madd(sx, static_cast<float>(acc), y);
          if constexpr (OFF == kOffset) {
            if (k0 + kQ == (g + 1) * p.group) y = madd(half_to_float(p.offset[g * N + n]), p.xsum[i * p.groups + g], y);
          }
        }
      p.y[i * N + n] = y;
    }
  }
}

template <int KIND, int OFF>
void item_dot(const Problem& p, int64_t item) {
  const int64_t N = p.n;
  const int64_t c0 = item * p.band, c1 = std::min(N, c0 + p.band);
  const int64_t W = (c1 - c0) / 64 * 64;
  if (W > 0) {
    for (int64_t i = 0; i < p.m; ++i) std::fill(p.y + i * N + c0, p.y + i * N + c0 + W, 0.f);
    if (p.m <= kDirectRows) {  // few rows: no panel, each weight read once straight into the dots
      for (int64_t g = 0; g < p.groups; ++g) {
        const int64_t g1 = (g + 1) * p.group;
        for (int64_t k0 = g * p.group; k0 < g1; k0 += kQ)
          for (int64_t c = 0; c < W; c += 64)
            direct_rows<KIND, OFF>(p, static_cast<int>(p.m), c0 + c, k0, g, k0 + kQ == g1);
      }
      if (c0 + W < c1) dot_tail_columns<KIND, OFF>(p, c0 + W, c1);
      return;
    }
    const int64_t qs = 4 * W + 64;  // a 4-row group's bytes, one line more (rows a multiple of 4 KB apart share L1 sets)
    uint8_t* buf = reinterpret_cast<uint8_t*>(scratch(static_cast<size_t>(qs * kQ / 4 / 4 + 16)));
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t g1 = (g + 1) * p.group;
      for (int64_t k0 = g * p.group; k0 < g1; k0 += kQ) {
        const bool last = k0 + kQ == g1;
        interleave_block<KIND>(p, k0, c0, W, qs, buf);
        for (int64_t c = 0; c < W; c += 64) {
          int64_t m0 = 0;
          for (; m0 + kDotRows <= p.m; m0 += kDotRows)
            dot_tile<kDotRows, KIND, OFF>(p, buf + 4 * c, qs, m0, c0 + c, k0, g, last);
          if (m0 < p.m) dot_rest<KIND, OFF>(p, static_cast<int>(p.m - m0), buf + 4 * c, qs, m0, c0 + c, k0, g, last);
        }
      }
    }
  }
  if (c0 + W < c1) dot_tail_columns<KIND, OFF>(p, c0 + W, c1);
}


// [N, K] int8 (w_contract 1, a tied LM head's [vocab, hidden] rows): each output is a dot product along a
// weight row, 64 bytes (two blocks of x) a VPDPBUSD. Per row of x, for each 4 contraction values (a lane)
// the correction -128 * (their xq sum) and their block's xs, computed once a call (lane_prep). Per output
// element, in order over the 64-byte chunks c of K: t = VPDPBUSD(corr, q + 128, xq) (per lane the exact
// integer sum of its 4 products), acc = fma(float(t), xs_lane (times the lane's group scale when groups are
// smaller than K), acc) in 16 lanes; then y = sum of the lanes (a fixed tree), times the row's scale when
// there is one per row. Every tile size and thread split runs these same steps for an element.

// Per row m: corr [M, K/4] int32 and xs per lane [M, K/4] float (zeros past K up to a multiple of 64).
void lane_prep(const Problem& p, int64_t kc, std::vector<int32_t>& corr, std::vector<float>& xsl) {
  const int64_t K = p.k, lanes = kc / 4, B = K / kQ;
  corr.assign(static_cast<size_t>(p.m * lanes), 0);
  xsl.assign(static_cast<size_t>(p.m * lanes), 0.f);
  for (int64_t m = 0; m < p.m; ++m)
    for (int64_t l = 0; l < K / 4; ++l) {
      const int8_t* q = p.xq + m * K + 4 * l;
      corr[m * lanes + l] = -128 * (q[0] + q[1] + q[2] + q[3]);
      xsl[m * lanes + l] = p.xsc[m * B + (4 * l) / kQ];
    }
}

// x quantized for one call (quantize_x; `lanes`: and lane_prep's arrays, for the [N, K] layout), owning the
// buffers the Problem points at while the call runs.
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> xs, xsl;
  std::vector<int32_t> qs, corr;
  Activations(Problem& p, bool lanes) {
    p.dot8 = true;
    quantize_x(p, xq, xs, qs);
    if (lanes) {
      lane_prep(p, (p.k + 63) / 64 * 64, corr, xsl);
      p.xcorr = corr.data();
      p.xlane = xsl.data();
    }
  }
};

template <int MT, int NT, bool GROUPED>
inline void panel_t(const Problem& p, const int32_t* corr, const float* xsl, int64_t kc, int64_t m0, int64_t n0) {
  const int64_t K = p.k, lanes = kc / 4, G = p.groups;
  const int8_t* w = static_cast<const int8_t*>(p.w) + n0 * K;
  const uint16_t* sc = p.scale + n0 * G;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MT][NT];
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < kc; c += 64) {
    const __mmask64 mask = c + 64 <= K ? ~__mmask64{0} : (__mmask64{1} << (K - c)) - 1;  // K - c is 32 here
    __m512i xv[MT], cv[MT];
    __m512 sv[MT];
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      xv[i] = _mm512_maskz_loadu_epi8(mask, p.xq + (m0 + i) * K + c);
      cv[i] = _mm512_loadu_si512(corr + (m0 + i) * lanes + c / 4);
      sv[i] = _mm512_loadu_ps(xsl + (m0 + i) * lanes + c / 4);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      if ((c & 63) == 0) prefetch(w + t * K + c + kPrefetchT);
      const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + t * K + c), bias);
      __m512 gs = _mm512_setzero_ps();
      if constexpr (GROUPED) {  // the group scales of the chunk's two blocks, 8 lanes each
        const float lo = half_to_float(sc[t * G + c / p.group]);
        const float hi = half_to_float(sc[t * G + std::min(K - 1, c + kQ) / p.group]);
        gs = _mm512_mask_blend_ps(static_cast<__mmask16>(0xff00), _mm512_set1_ps(lo), _mm512_set1_ps(hi));
      }
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv[i], wv, xv[i]));
        acc[i][t] = _mm512_fmadd_ps(d, GROUPED ? _mm512_mul_ps(sv[i], gs) : sv[i], acc[i][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const float r = _mm512_reduce_add_ps(acc[i][t]);
      p.y[(m0 + i) * p.n + n0 + t] = GROUPED ? r : r * half_to_float(sc[t * G]);
    }
}

constexpr int kTileRowsT = 4, kWeightRowsT = 4;  // x rows by weight rows a tile: 16 accumulators

template <int MT, bool GROUPED>
void tile_t(const Problem& p, const int32_t* corr, const float* xsl, int64_t kc, int64_t m0, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kWeightRowsT <= r1; r += kWeightRowsT) panel_t<MT, kWeightRowsT, GROUPED>(p, corr, xsl, kc, m0, r);
  for (; r < r1; ++r) panel_t<MT, 1, GROUPED>(p, corr, xsl, kc, m0, r);
}

template <bool GROUPED>
void item_t_rows(const Problem& p, const int32_t* corr, const float* xsl, int64_t kc, int64_t r0, int64_t r1) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kTileRowsT) {
    switch (std::min<int64_t>(kTileRowsT, p.m - m0)) {
      case 1: tile_t<1, GROUPED>(p, corr, xsl, kc, m0, r0, r1); break;
      case 2: tile_t<2, GROUPED>(p, corr, xsl, kc, m0, r0, r1); break;
      case 3: tile_t<3, GROUPED>(p, corr, xsl, kc, m0, r0, r1); break;
      default: tile_t<kTileRowsT, GROUPED>(p, corr, xsl, kc, m0, r0, r1); break;
    }
  }
}

void item_t(const Problem& p, int64_t item) {
  const int64_t r0 = item * p.band, r1 = std::min(p.n, r0 + p.band);
  const int64_t kc = (p.k + 63) / 64 * 64;
  if (p.groups == 1)
    item_t_rows<false>(p, p.xcorr, p.xlane, kc, r0, r1);
  else
    item_t_rows<true>(p, p.xcorr, p.xlane, kc, r0, r1);
}

void run_item(const Problem& p, int64_t item) {
  if (p.transposed) return item_t(p, item);
  switch (p.kind * 3 + p.offset_mode) {
    case kI8 * 3 + kNoOffset: return item_dot<kI8, kNoOffset>(p, item);
    case kI8 * 3 + kOffset: return item_dot<kI8, kOffset>(p, item);
    case kU4 * 3 + kOffset: return item_dot<kU4, kOffset>(p, item);
    case kU4 * 3 + kMinus8: return item_dot<kU4, kMinus8>(p, item);
    default: return;
  }
}

}  // namespace vnni
#endif  // JAXINFER_VNNI

// ---------------------------------------------------------------------------
// AMX, bfloat16 weights: y = bf16(x) @ w on the tile unit
//
// Where the build and the CPU have AMX and the caller asks for it (attr bf16_dot), a bfloat16
// weight's products run on the tiles, as oneDNN's and llama.cpp's bfloat16 products do: x is
// rounded to bfloat16 (to nearest even) and each output element is one float32 accumulator of a
// tile: 0, then one TDPBF16PS per block of contraction rows, in order. Contraction rows past K are
// zeros in x and in w (a zero-padded copy of the last block), and so are columns past N. The tile
// unit's sum inside one TDPBF16PS is its own (no sequence of FMAs reproduces it: measured), so the
// same instructions run for any M: a tile product treats its rows independently, so a row's result is
// bitwise the same alone, in any batch, in any grouping of tiles and on any thread split.
//
// [K, N] (the layers' weights): the weight is the B operand as it lies in memory (see item_kn), 16
// contraction rows a product.
// [N, K] (a tied LM head): the weight's rows are the A operand as they lie in memory (16 rows, 32
// contraction values each); x as column pairs is the B operand; up to four tiles of 16 rows of x
// share each weight tile. The accumulator holds y transposed.

#ifdef JAXINFER_AMX
namespace amx {

bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for the tile state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 64 bytes wide: 0-3 accumulators (float32), 4-5 the A operand, 6-7 the B operand (16 rows).
// `rows`: the accumulators' and A's rows (16; fewer for a decode step's few rows of x, so that the
// accumulators' trips to memory move only those rows: a row's sums do not depend on the tile's rows).
// Each work item configures its thread's tiles and releases them at its end (XLA's other work on the
// thread may use the tiles with a configuration of its own).
inline void configure(int rows = 16) {
  Config c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
  }
  _tile_loadconfig(&c);
}

// 64-byte aligned (a tile row split over two cache lines loads at half the speed).
inline uint16_t* align64(uint16_t* p) {
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

uint16_t* scratch16(size_t n) {
  static thread_local std::vector<uint16_t> buf;
  if (buf.size() < n + 32) buf.resize(n + 32);
  return align64(buf.data());
}

inline __mmask16 first(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// A float32 row of K values rounded to bfloat16 into dst (kp values, zeros past K).
void round_row(const float* x, int64_t K, int64_t kp, uint16_t* dst) {
  for (int64_t k = 0; k < kp; k += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(first(K - k), x + std::min(k, K));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// x rounded to bfloat16, as the A or B operand its layout needs.
// [N, K]: xb [mp, kp] (K to a multiple of 32), and pairs [kp / 2, mp]: pairs[q][m] = x[m][2q] |
// x[m][2q + 1] << 16, the B operand (16 pairs of contraction rows by 16 rows of x a tile).
// [K, N]: two A operands [mp, 2 kp] (K to a multiple of 16): xb with x[m][k] at 2k and 0 at 2k + 1,
// xo with 0 at 2k and x[m][k] at 2k + 1 (see item_kn).
void pack(Problem& p, std::vector<uint16_t>& xb, std::vector<uint32_t>& pairs) {
  p.mp = (p.m + 15) / 16 * 16;
  if (!p.transposed) {
    p.kp = (p.k + 15) / 16 * 16;
    const int64_t row = 2 * p.kp;
    xb.assign(static_cast<size_t>(2 * p.mp * row + 32), 0);
    uint16_t* even = align64(xb.data());
    uint16_t* odd = even + p.mp * row;
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t k = 0; k < p.kp; k += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(first(p.k - k), p.x + i * p.k + std::min(k, p.k));
        const __m512i d = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));  // (x, 0) pairs
        _mm512_store_si512(even + i * row + 2 * k, d);
        _mm512_store_si512(odd + i * row + 2 * k, _mm512_slli_epi32(d, 16));  // (0, x) pairs
      }
    p.xb = even;
    p.xo = odd;
    return;
  }
  p.kp = (p.k + 31) / 32 * 32;
  xb.assign(static_cast<size_t>(p.mp * p.kp + 32), 0);
  uint16_t* rows = align64(xb.data());
  for (int64_t i = 0; i < p.m; ++i) round_row(p.x + i * p.k, p.k, p.kp, rows + i * p.kp);
  p.xb = rows;
  const int64_t kq = p.kp / 2;
  pairs.resize(static_cast<size_t>(kq * p.mp + 16));
  uint32_t* at = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(pairs.data()) + 63) & ~uintptr_t{63});
  for (int64_t i = 0; i < p.mp; ++i)
    for (int64_t q = 0; q < kq; ++q) std::memcpy(at + q * p.mp + i, rows + i * p.kp + 2 * q, 4);
  p.xpairs = at;
}

// An accumulator of the [N, K] path (16 weight rows by 16 rows of x, float32, stored in c) into y:
// y[m0 + j][n0 + i] = c[i][j], for the rows and columns that exist.
inline void write_transposed(const Problem& p, const float* c, int64_t m0, int64_t n0) {
  const int64_t rows = std::min<int64_t>(16, p.m - m0), cols = std::min<int64_t>(16, p.n - n0);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < cols; ++i) p.y[(m0 + j) * p.n + n0 + i] = c[i * 16 + j];
}

// The tile intrinsics take the tile's number as a literal.
#define JAXINFER_AMX_WRITE_T(T, p, m0, n0) \
  do {                                      \
    alignas(64) float c_[16 * 16];          \
    _tile_stored(T, c_, 64);                \
    write_transposed(p, c_, m0, n0);        \
  } while (0)

// [K, N]: 16 weight rows by 32 columns as they lie in memory (stride N), or, past the weight's last row
// or column, a zero-padded copy in `pad` (16 x 32).
inline const uint16_t* b_tile(const Problem& p, int64_t k0, int64_t n0, int64_t& stride, uint16_t* pad) {
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  if (k0 + 16 <= p.k && n0 + 32 <= p.n) {
    stride = p.n * 2;
    return w + k0 * p.n + n0;
  }
  const int64_t rows = std::min<int64_t>(16, p.k - k0), left = p.n - n0;
  const __mmask32 m = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1);
  for (int64_t r = 0; r < 16; ++r)
    _mm512_store_si512(pad + r * 32, r < rows ? _mm512_maskz_loadu_epi16(m, w + (k0 + r) * p.n + n0)
                                              : _mm512_setzero_si512());
  stride = 64;
  return pad;
}

// Two accumulators (even and odd columns of the 32 at n0, as float32 16 x 16 each) into y's rows from m0.
inline void write_pair(const Problem& p, const float* even, const float* odd, int64_t m0, int64_t n0) {
  const int64_t rows = std::min<int64_t>(16, p.m - m0), cols = std::min<int64_t>(32, p.n - n0);
  for (int64_t i = 0; i < rows; ++i) {
    float* y = p.y + (m0 + i) * p.n + n0;
    for (int64_t c = 0; c < cols; ++c) y[c] = (c & 1 ? odd : even)[i * 16 + c / 2];
  }
}

#define JAXINFER_AMX_WRITE_PAIR(E, O, p, m0, n0) \
  do {                                           \
    alignas(64) float e_[16 * 16], o_[16 * 16];  \
    _tile_stored(E, e_, 64);                     \
    _tile_stored(O, o_, 64);                     \
    write_pair(p, e_, o_, m0, n0);               \
  } while (0)

// [K, N] (the layers' weights): the B operand is the weight as it lies in memory, 16 rows of 32 columns,
// read once; no copy. TDPBF16PS pairs B's 16-bit values along its rows, i.e. two neighbouring columns,
// so each 16 contraction rows take two products: one with x in the even lanes of A's pairs (and zeros
// in the odd: the even columns' sums) and one with x in the odd lanes (the odd columns'). Each output
// element is one accumulator: 0, then for each 16 contraction rows in order one TDPBF16PS (its 16 pairs
// x[k] w[k][n] and 0 w[k][n +- 1]). A work item is a band of columns, 64 at a time (four accumulators:
// two 32-column tiles, even and odd), each over every 16 rows of x and all of K; the weight streams
// from memory for x's first 16 rows and from cache for the others.
// At most 16 rows of x (decode): the weight streams 16 rows at a time across the band's columns (each
// row's run of the band read together: measured on cold weights, as fast as the float path's order and
// ~1.6x the column-block-first order below), the accumulators waiting in L1 between two blocks of rows
// (a float32 store and load of x's rows only: the same sums as in the tile registers).
void item_kn_decode(const Problem& p, int64_t c0, int64_t c1) {
  const int64_t N = p.n, K = p.k;
  const int64_t row = 2 * p.kp, astride = row * 2, blocks = p.kp / 16;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  uint16_t* pad = scratch16(2 * 16 * 32);
  const int64_t pairs = (c1 - c0 + 63) / 64;
  static thread_local std::vector<float> acc_buf;
  if (acc_buf.size() < static_cast<size_t>(pairs * 4 * 256 + 16)) acc_buf.resize(pairs * 4 * 256 + 16);
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_buf.data()) + 63) & ~uintptr_t{63});
  configure(static_cast<int>(p.m));
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = 16 * kb;
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t n0 = c0 + 64 * j;
      const bool two = n0 + 32 < c1;
      float* c = acc + j * 4 * 256;
      if (kb == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + 256, 64);
        _tile_loadd(2, c + 512, 64);
        _tile_loadd(3, c + 768, 64);
      }
      // the next 16 rows (measured on the chained SmolLM2 weights at one row: ~6% faster than 32 rows ahead,
      // whose lines, two sweeps of a 768-column band ahead, no longer all fit in L1 when they are read)
      if (k0 + 16 < K)
        for (int64_t r = 0; r < 16; ++r) {
          prefetch(w + (k0 + 16 + r) * N + n0);
          if (two) prefetch(w + (k0 + 16 + r) * N + n0 + 32);
        }
      int64_t s0 = 0, s1 = 0;
      _tile_loadd(4, p.xb + kb * 32, astride);
      _tile_loadd(5, p.xo + kb * 32, astride);
      _tile_loadd(6, b_tile(p, k0, n0, s0, pad), s0);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, b_tile(p, k0, n0 + 32, s1, pad + 16 * 32), s1);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, 64);
      _tile_stored(1, c + 256, 64);
      _tile_stored(2, c + 512, 64);
      _tile_stored(3, c + 768, 64);
    }
  }
  _tile_release();
  for (int64_t j = 0; j < pairs; ++j) {
    const float* c = acc + j * 4 * 256;
    write_pair(p, c, c + 256, 0, c0 + 64 * j);
    if (c0 + 64 * j + 32 < c1) write_pair(p, c + 512, c + 768, 0, c0 + 64 * j + 32);
  }
}

void item_kn(const Problem& p, int64_t item) {
  const int64_t N = p.n, K = p.k;
  const int64_t c0 = item * p.band, c1 = std::min(N, c0 + p.band);
  if (p.mp == 16) return item_kn_decode(p, c0, c1);
  // More rows (prefill): for each 64 columns, the weight's K x 64 copied once, as it is, into contiguous
  // tiles (stage: block kb's two tiles at (2 kb + t) * 512, zeros past K and N; kept in L2), then every
  // 16 rows of x over it, all of K in the four tile registers.
  const int64_t row = 2 * p.kp, astride = row * 2, blocks = p.kp / 16;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  uint16_t* stage = scratch16(static_cast<size_t>(blocks * 2 * 512));
  configure();
  for (int64_t n0 = c0; n0 < c1; n0 += 64) {
    const bool two = n0 + 32 < c1;
    const int64_t left0 = std::min<int64_t>(32, c1 - n0), left1 = std::max<int64_t>(0, std::min<int64_t>(32, c1 - n0 - 32));
    const __mmask32 m0mask = left0 >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left0) - 1);
    const __mmask32 m1mask = left1 >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left1) - 1);
    for (int64_t k = 0; k < p.kp; ++k) {
      uint16_t* dst = stage + ((k / 16) * 2) * 512 + (k % 16) * 32;
      const bool in = k < K;
      if (in && k + kPrefetchRows < K) {
        prefetch(w + (k + kPrefetchRows) * N + n0);
        prefetch(w + (k + kPrefetchRows) * N + n0 + 32);
      }
      _mm512_store_si512(dst, in ? _mm512_maskz_loadu_epi16(m0mask, w + k * N + n0) : _mm512_setzero_si512());
      _mm512_store_si512(dst + 512, in && two ? _mm512_maskz_loadu_epi16(m1mask, w + k * N + n0 + 32)
                                              : _mm512_setzero_si512());
    }
    for (int64_t m0 = 0; m0 < p.mp; m0 += 16) {
      const uint16_t* ae = p.xb + m0 * row;
      const uint16_t* ao = p.xo + m0 * row;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < blocks; ++kb) {
        _tile_loadd(4, ae + kb * 32, astride);
        _tile_loadd(5, ao + kb * 32, astride);
        _tile_loadd(6, stage + 2 * kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, stage + (2 * kb + 1) * 512, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      JAXINFER_AMX_WRITE_PAIR(0, 1, p, m0, n0);
      if (two) JAXINFER_AMX_WRITE_PAIR(2, 3, p, m0, n0 + 32);
    }
  }
  _tile_release();
}

void item_t(const Problem& p, int64_t item) {
  const int64_t N = p.n, K = p.k;
  const int64_t r0 = item * p.band, r1 = std::min(N, r0 + p.band);
  const uint16_t* w = static_cast<const uint16_t*>(p.w);
  const int64_t blocks = p.kp / 32, bstride = p.mp * 4;
  configure();
  for (int64_t n0 = r0; n0 < r1; n0 += 16) {
    const int64_t rows = std::min<int64_t>(16, r1 - n0);
    const uint16_t* a = w + n0 * K;
    int64_t stride = K * 2;
    const bool direct = rows == 16 && K == p.kp;
    if (!direct) {  // a copy with zeros past the weight's rows and K
      uint16_t* pad = scratch16(static_cast<size_t>(16 * p.kp));
      std::fill(pad, pad + 16 * p.kp, uint16_t{0});
      for (int64_t i = 0; i < rows; ++i) std::memcpy(pad + i * p.kp, w + (n0 + i) * K, K * sizeof(uint16_t));
      a = pad;
      stride = p.kp * 2;
    }
    for (int64_t g = 0; g < p.mp; g += 64) {  // up to four tiles of 16 rows of x share each weight tile
      const int64_t nt = std::min<int64_t>(4, (p.mp - g) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < blocks; ++kb) {
        if (direct && g == 0)
          for (int i = 0; i < 16; ++i) prefetch(reinterpret_cast<const char*>(a + i * K + kb * 32) + kPrefetchT);
        _tile_loadd(4, a + kb * 32, stride);
        const uint32_t* b = p.xpairs + kb * 16 * p.mp + g;
        _tile_loadd(6, b, bstride);
        _tile_dpbf16ps(0, 4, 6);
        if (nt > 1) {
          _tile_loadd(7, b + 16, bstride);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (nt > 2) {
          _tile_loadd(6, b + 32, bstride);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (nt > 3) {
          _tile_loadd(7, b + 48, bstride);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      JAXINFER_AMX_WRITE_T(0, p, g, n0);
      if (nt > 1) JAXINFER_AMX_WRITE_T(1, p, g + 16, n0);
      if (nt > 2) JAXINFER_AMX_WRITE_T(2, p, g + 32, n0);
      if (nt > 3) JAXINFER_AMX_WRITE_T(3, p, g + 48, n0);
    }
  }
  _tile_release();
}

}  // namespace amx
#endif  // JAXINFER_AMX

bool amx_available() {
#ifdef JAXINFER_AMX
  return amx::permitted();
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------
// work sharing

bool vnni_available() {
#ifdef JAXINFER_VNNI
  return true;
#else
  return false;
#endif
}

void run_item(const Problem& p, int64_t item) {
#ifdef JAXINFER_AMX
  if (p.amx) return p.transposed ? amx::item_t(p, item) : amx::item_kn(p, item);
#endif
#ifdef JAXINFER_VNNI
  if (p.dot8) return vnni::run_item(p, item);
#endif
  if (p.transposed) {
    switch (p.kind) {
      case kI8: return item_qt(p, item);
      case kF32: return item_t<kF32>(p, item);
      case kBF16: return item_t<kBF16>(p, item);
      case kF16: return item_t<kF16>(p, item);
      default: return;
    }
  }
  switch (p.kind * 3 + p.offset_mode) {
    case kF32 * 3 + kNoOffset: return item_kn<kF32, kNoOffset>(p, item);
    case kBF16 * 3 + kNoOffset: return item_kn<kBF16, kNoOffset>(p, item);
    case kF16 * 3 + kNoOffset: return item_kn<kF16, kNoOffset>(p, item);
    case kI8 * 3 + kNoOffset: return item_kn<kI8, kNoOffset>(p, item);
    case kI8 * 3 + kOffset: return item_kn<kI8, kOffset>(p, item);
    case kU4 * 3 + kOffset: return item_kn<kU4, kOffset>(p, item);
    case kU4 * 3 + kMinus8: return item_kn<kU4, kMinus8>(p, item);
    default: return;
  }
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run_items(const Problem& p, Progress& prog) {
  for (;;) {
    const int64_t item = prog.next.fetch_add(1);
    if (item >= p.items) return;
    run_item(p, item);
    prog.done.fetch_add(1, std::memory_order_release);
  }
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Chooses the [K, N] path: few rows, one tile, weights widened in registers; more, blocked over converted
// panels. (Each tile broadcasts its rows' x from x itself: a copy of x repacked per tile, which the calling
// thread made alone before the others started, cost ~10% of a 128-row prefill's products.)
void choose_kn_path(Problem& p) { p.blocked = p.m > kMaxTile; }

// Splits the output columns into items, then runs them on the calling thread and up to
// `pool.num_threads() - 1` pool threads. `unit`: the column granularity of a band.
void run(ffi::ThreadPool& pool, bool share, Problem& p, int64_t unit, int64_t weight_bytes) {
  const int64_t threads = share ? std::max<int64_t>(1, pool.num_threads()) : 1;
  // A product this small is done before a pool thread wakes up.
  const bool alone = threads == 1 || weight_bytes * std::max<int64_t>(1, p.m) < (64 << 10);
  const int64_t units = (p.n + unit - 1) / unit;
  // Wide bands stream better (a band's rows are read left to right); as few items as keep a
  // band within kMaxBandUnits, in a multiple of the thread count so that threads get equal shares.
  const int64_t max_units = !p.transposed && p.m <= kFewRows ? 2 * kMaxBandUnits : kMaxBandUnits;
  int64_t per = std::min<int64_t>(units, max_units);
  if (!alone) {
    for (int64_t c = 1;; ++c) {
      per = (units + threads * c - 1) / (threads * c);
      if (per <= max_units) break;
    }
  }
  p.band = per * unit;
  p.items = (p.n + p.band - 1) / p.band;
  auto prog = std::make_shared<Progress>();
  const int64_t helpers = alone ? 0 : std::min<int64_t>(threads, p.items) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    // `p` is copied; its pointers are used only while items remain, i.e. before we return.
    pool.Schedule([prog, p] { run_items(p, *prog); });
  }
  run_items(p, *prog);
  // Items are even, so the others finish soon: spin briefly (a yield is a system call, and
  // there are ~120 of these calls a decode step), then yield to whoever holds the core.
  for (int spin = 0; prog->done.load(std::memory_order_acquire) < p.items; ++spin) {
    if (spin < 2000)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U8: return "uint8";
    default: return "another type";
  }
}

ffi::Error MatmulFloat(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, int64_t w_contract,
                       bool share, bool bf16_dot, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("cpu matmul: x, w and y must be 2-D; got x " + dims_str(xd) + ", w " +
                                       dims_str(wd) + ", y " + dims_str(yd));
  const ffi::DataType wt = w.element_type();
  if (wt != ffi::DataType::F32 && wt != ffi::DataType::BF16 && wt != ffi::DataType::F16)
    return ffi::Error::InvalidArgument(std::string("cpu matmul: w must be float32, bfloat16 or float16, got ") +
                                       dtype_name(wt));
  if (w_contract != 0 && w_contract != 1)
    return ffi::Error::InvalidArgument("cpu matmul: w_contract must be 0 or 1, got " + std::to_string(w_contract));
  Problem p;
  p.m = xd[0];
  p.k = xd[1];
  p.n = wd[1 - w_contract];
  if (wd[w_contract] != p.k)
    return ffi::Error::InvalidArgument("cpu matmul: x " + dims_str(xd) + " and w " + dims_str(wd) +
                                       " do not agree on the contraction (w_contract " + std::to_string(w_contract) +
                                       ")");
  if (yd[0] != p.m || yd[1] != p.n)
    return ffi::Error::InvalidArgument("cpu matmul: y " + dims_str(yd) + " should be [" + std::to_string(p.m) + ", " +
                                       std::to_string(p.n) + "]");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.x = x.typed_data();
  p.w = w.untyped_data();
  p.y = y->typed_data();
  p.kind = wt == ffi::DataType::F32 ? kF32 : (wt == ffi::DataType::BF16 ? kBF16 : kF16);
  p.group = std::max<int64_t>(1, p.k);
  p.groups = p.k == 0 ? 0 : 1;
  p.transposed = w_contract == 1;
  if (bf16_dot && p.kind == kBF16) {
    if (!amx_available())
      return ffi::Error::InvalidArgument("cpu matmul: bf16_dot asks for AMX bfloat16 products, which this build or "
                                         "CPU does not have (JaxinferMatmulAmx() says whether it does)");
#ifdef JAXINFER_AMX
    p.amx = true;
    std::vector<uint16_t> xb;
    std::vector<uint32_t> pairs;
    amx::pack(p, xb, pairs);
    if (p.transposed)
      run(pool, share, p, 16, p.k * p.n * 2);
    else
      run(pool, share, p, 64, p.k * p.n * 2);
    return ffi::Error::Success();
#endif
  }
  if (p.transposed) {
    run(pool, share, p, kRowsT, p.k * p.n * elem_bytes(p.kind));
  } else {
    choose_kn_path(p);
    run(pool, share, p, 4 * Vec::L, p.k * p.n * elem_bytes(p.kind));
  }
  return ffi::Error::Success();
}

// The [N, K] int8 layout (w_contract 1): q int8 [N, K], scale f16 [N, K/group], no offset.
ffi::Error MatmulQT(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& q, ffi::Buffer<ffi::F16>& scale,
                    ffi::Buffer<ffi::F16>& offset, int64_t bits, int64_t group, bool share, bool int8_dot,
                    ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  const auto yd = y->dimensions();
  if (bits != 8 || q.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("cpu quantized matmul: w_contract 1 ([N, K]) takes int8 q (bits 8) only, got "
                                       "bits " + std::to_string(bits));
  if (od[0] != 0)
    return ffi::Error::InvalidArgument("cpu quantized matmul: w_contract 1 ([N, K]) takes no offset, got offset " +
                                       dims_str(od));
  Problem p;
  p.m = xd[0];
  p.k = xd[1];
  p.n = qd[0];
  if (qd[1] != p.k)
    return ffi::Error::InvalidArgument("cpu quantized matmul: x " + dims_str(xd) + " and q " + dims_str(qd) +
                                       " do not agree on the contraction (q is [N, K] for w_contract 1)");
  if (group <= 0 || p.k % group != 0)
    return ffi::Error::InvalidArgument("cpu quantized matmul: group " + std::to_string(group) +
                                       " must be positive and divide K = " + std::to_string(p.k));
  p.group = group;
  p.groups = p.k / group;
  if (sd[0] != p.n || sd[1] != p.groups)
    return ffi::Error::InvalidArgument("cpu quantized matmul: scale " + dims_str(sd) + " should be [" +
                                       std::to_string(p.n) + ", " + std::to_string(p.groups) +
                                       "] (N, K / group) for w_contract 1");
  if (yd[0] != p.m || yd[1] != p.n)
    return ffi::Error::InvalidArgument("cpu quantized matmul: y " + dims_str(yd) + " should be [" +
                                       std::to_string(p.m) + ", " + std::to_string(p.n) + "]");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.kind = kI8;
  p.transposed = true;
  p.x = x.typed_data();
  p.w = q.untyped_data();
  p.scale = scale.typed_data();
  p.y = y->typed_data();
#ifdef JAXINFER_VNNI
  if (int8_dot) {  // checked by MatmulQ
    vnni::Activations a(p, true);
    run(pool, share, p, vnni::kWeightRowsT, p.n * p.k + 2 * p.n * p.groups);
    return ffi::Error::Success();
  }
#else
  (void)int8_dot;  // MatmulQ refuses it on a build without VNNI
#endif
  run(pool, share, p, kRowsT, p.n * p.k + 2 * p.n * p.groups);
  return ffi::Error::Success();
}

ffi::Error MatmulQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                   ffi::Buffer<ffi::F16> offset, int64_t bits, int64_t group, int64_t w_contract, bool share,
                   bool int8_dot, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || od.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("cpu quantized matmul: x, q, scale, offset and y must be 2-D; got x " +
                                       dims_str(xd) + ", q " + dims_str(qd) + ", scale " + dims_str(sd) +
                                       ", offset " + dims_str(od) + ", y " + dims_str(yd));
  if (bits != 8 && bits != 4)
    return ffi::Error::InvalidArgument("cpu quantized matmul: bits must be 8 or 4, got " + std::to_string(bits));
  const auto want = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (q.element_type() != want)
    return ffi::Error::InvalidArgument(std::string("cpu quantized matmul: q must be ") +
                                       (bits == 8 ? "int8" : "uint8 (two int4 per byte)") + " for bits " +
                                       std::to_string(bits));
  if (w_contract != 0 && w_contract != 1)
    return ffi::Error::InvalidArgument("cpu quantized matmul: w_contract must be 0 or 1, got " +
                                       std::to_string(w_contract));
  if (int8_dot) {
    if (!vnni_available())
      return ffi::Error::InvalidArgument("cpu quantized matmul: int8_dot asks for VNNI integer products, which this "
                                         "build does not have (JaxinferMatmulVnni() says whether it does)");
    if (group <= 0 || group % 32 != 0)
      return ffi::Error::InvalidArgument("cpu quantized matmul: int8_dot takes groups of a multiple of 32 "
                                         "contraction rows, got group " + std::to_string(group));
  }
  if (w_contract == 1) return MatmulQT(pool, x, q, scale, offset, bits, group, share, int8_dot, y);
  Problem p;
  p.m = xd[0];
  p.k = xd[1];
  p.n = qd[1];
  const int64_t q_rows = bits == 8 ? p.k : p.k / 2;
  if (qd[0] != q_rows || (bits == 4 && p.k % 2 != 0))
    return ffi::Error::InvalidArgument("cpu quantized matmul: x " + dims_str(xd) + " and q " + dims_str(qd) +
                                       " do not agree on the contraction (q has K" + (bits == 4 ? "/2" : "") +
                                       " rows for bits " + std::to_string(bits) + ")");
  if (group <= 0 || p.k % group != 0 || (bits == 4 && group % 2 != 0))
    return ffi::Error::InvalidArgument("cpu quantized matmul: group " + std::to_string(group) +
                                       " must be positive, divide K = " + std::to_string(p.k) +
                                       (bits == 4 ? " and be even" : ""));
  p.group = group;
  p.groups = p.k / group;
  if (sd[0] != p.groups || sd[1] != p.n)
    return ffi::Error::InvalidArgument("cpu quantized matmul: scale " + dims_str(sd) + " should be [" +
                                       std::to_string(p.groups) + ", " + std::to_string(p.n) + "] (K / group, N)");
  const bool has_offset = od[0] != 0;
  if (has_offset && (od[0] != p.groups || od[1] != p.n))
    return ffi::Error::InvalidArgument("cpu quantized matmul: offset " + dims_str(od) + " should be [" +
                                       std::to_string(p.groups) + ", " + std::to_string(p.n) +
                                       "] (K / group, N), or [0, N] for none");
  if (yd[0] != p.m || yd[1] != p.n)
    return ffi::Error::InvalidArgument("cpu quantized matmul: y " + dims_str(yd) + " should be [" +
                                       std::to_string(p.m) + ", " + std::to_string(p.n) + "]");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.kind = bits == 8 ? kI8 : kU4;
  p.offset_mode = has_offset ? kOffset : (bits == 4 ? kMinus8 : kNoOffset);
  p.x = x.typed_data();
  p.w = q.untyped_data();
  p.scale = scale.typed_data();
  p.offset = has_offset ? offset.typed_data() : nullptr;
  p.y = y->typed_data();
  std::vector<float> xsum;
  if (p.offset_mode != kNoOffset && !int8_dot) {
    xsum.assign(p.m * p.groups, 0.f);
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t g = 0; g < p.groups; ++g) {
        const float* xr = p.x + i * p.k + g * group;
        float s = 0.f;
        for (int64_t k = 0; k < group; ++k) s += xr[k];
        xsum[i * p.groups + g] = s;
      }
    p.xsum = xsum.data();
  }
  const int64_t weight_bytes = q_rows * p.n + 2 * (sd[0] + od[0]) * p.n;
#ifdef JAXINFER_VNNI
  if (int8_dot) {  // checked above; with an offset, the group sums of x as quantized
    vnni::Activations a(p, false);
    if (p.offset_mode == kOffset) {
      xsum.assign(p.m * p.groups, 0.f);
      vnni::quantized_sums(p, xsum);
      p.xsum = xsum.data();
    }
    run(pool, share, p, 64, weight_bytes);
    return ffi::Error::Success();
  }
#endif
  choose_kn_path(p);
  run(pool, share, p, 4 * Vec::L, weight_bytes);
  return ffi::Error::Success();
}

}  // namespace

extern "C" const char* JaxinferMatmulIsa() { return kIsa; }

// 1 where bfloat16 weights can take the AMX path (attr bf16_dot): built with AMX and granted the tile state.
extern "C" int JaxinferMatmulAmx() { return amx_available() ? 1 : 0; }

// 1 where quantized [K, N] weights can take the VNNI path (attr int8_dot): built with AVX512-VNNI.
extern "C" int JaxinferMatmulVnni() { return vnni_available() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferMatmulFloat, MatmulFloat,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w f32 / bf16 / f16 [K, N] or [N, K]
                                  .Attr<int64_t>("w_contract")   // the axis of w that meets x's K
                                  .Attr<bool>("share")           // share the items with the intra-op pool
                                  .Attr<bool>("bf16_dot")        // bfloat16 w: AMX products of bf16(x)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferMatmulQ, MatmulQ,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // q int8 [K, N] or uint8 [K/2, N]; int8 [N, K]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scale [K/group, N]; [N, K/group]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // offset [K/group, N] or [0, N]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("w_contract")   // 0: q [K, N]; 1: int8 q [N, K]
                                  .Attr<bool>("share")
                                  .Attr<bool>("int8_dot")        // [K, N]: VNNI products of x quantized per block
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
