// Causal attention over the paged KV cache, for XLA's CPU backend (an XLA FFI handler).
//
// XLA lowers the page gather of the pure-JAX path to an element-by-element copy, and that
// gather, with the masked softmax over the gathered copy, was most of a batched CPU step.
// This kernel reads each sequence's pages where they lie, in page-sized blocks, with an
// online softmax, so the context is read once and never copied.
//
// Layout (see jaxinfer/kv_cache.py): cache [num_pages, page_size, 2*KVH, D] with K at even and
// V at odd head indices. The kernel first writes the chunk's own keys/values into their slots
// (the cache is an input aliased to an output, so the write is in place), then attends.
//
//   q          [B, T, H, D]    float32   queries (RoPE applied)
//   k, v       [B, T, KVH, D]  float32   the chunk's keys (RoPE applied) and values
//   cache      [P, S, 2*KVH, D]          float32 or bfloat16 (rounded to nearest even)
//   page_table [B, NP]         int32     pages of each row, in order
//   positions  [B, T]          int32     position of each token; -1: padding (not written,
//                                        output zeros)
//   out        [B, T, H, D]    float32;  cache_out: the cache, updated (aliases `cache`)
//
// Query token at position p attends keys 0..p of its row (causal; grouped-query heads share
// their kv head); with the `window` attribute w > 0, only keys p-w+1..p (sliding window: the
// blocks before a row's window are never read, so those pages may be gone). Work items are (row, kv head, tile of query tokens), shared with XLA's
// intra-op thread pool. Keys and values are read from the cache a vector (16 elements of
// head_dim) at a time, converted from bfloat16 on the fly. Two inner loops:
//   * one query token (decode): keys are scored by dot products over head_dim;
//   * a tile of tokens (prefill): the tile's query rows (tokens x grouped heads) are held
//     transposed, so each key element is broadcast against vectors of rows and the
//     scores, the running max and the softmax weights are all row-vectors; no horizontal
//     reductions, no transposes of the cache. Four keys (and two rows for the values)
//     are in flight at once so the multiply-adds do not wait on each other.
// head_dim must be 16, 32, 64, 128 or 256 (Gemma 3) (jaxinfer/attention.py checks before calling).

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

constexpr int kMaxDV = 16;        // head_dim / 16, at most
constexpr int kMaxGroup = 64;     // query heads per kv head
constexpr int kBlock = kLanes;    // keys per block (never more than what is left of a page)
constexpr int kTileRows = 48;     // target query rows (tokens x grouped heads) per prefill tile
constexpr int kMaxNV = 4;         // row vectors per tile
constexpr float kNeg = -1e30f;    // masked score (finite: no inf - inf)

inline vf splat(float x) { return vf{} + x; }

inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline vf load(const uint16_t* p) {  // bfloat16 -> float32: the high half of the bits
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vi bits = __builtin_convertvector(h, vi) << 16;
  vf x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Horizontal sum / max by halving (4 shuffles): a sequential 16-lane chain costs ~4x the latency.
#if defined(__clang__)
#define JI_SWAP(x, a) \
  __builtin_shufflevector(x, x, (0 ^ a), (1 ^ a), (2 ^ a), (3 ^ a), (4 ^ a), (5 ^ a), (6 ^ a), (7 ^ a), (8 ^ a), \
                          (9 ^ a), (10 ^ a), (11 ^ a), (12 ^ a), (13 ^ a), (14 ^ a), (15 ^ a))
#else
#define JI_SWAP(x, a) \
  __builtin_shuffle(x, vi{0 ^ a, 1 ^ a, 2 ^ a, 3 ^ a, 4 ^ a, 5 ^ a, 6 ^ a, 7 ^ a, 8 ^ a, 9 ^ a, 10 ^ a, 11 ^ a, \
                          12 ^ a, 13 ^ a, 14 ^ a, 15 ^ a})
#endif

inline float hsum(vf x) {
  x += JI_SWAP(x, 8);
  x += JI_SWAP(x, 4);
  x += JI_SWAP(x, 2);
  x += JI_SWAP(x, 1);
  return x[0];
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf x) {
  x = vmax(x, JI_SWAP(x, 8));
  x = vmax(x, JI_SWAP(x, 4));
  x = vmax(x, JI_SWAP(x, 2));
  x = vmax(x, JI_SWAP(x, 1));
  return x[0];
}

// exp for a vector (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~2 ulp).
inline vf vexp(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting rounds to nearest
  vf k = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - k * 0.693359375f + k * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Per-thread working memory (kept off the stack).
struct Scratch {
  vf acc[kMaxNV * kLanes][kMaxDV];  // output accumulators, one row per query row
  vf qt[kMaxDV * kLanes][kMaxNV];   // tile queries transposed: qt[i] is element i of every row
  vf q[kMaxGroup][kMaxDV];          // decode queries
  vf w[kBlock][kMaxNV];             // tile softmax weights: w[j] holds key j's weight for every row
  float s[kMaxGroup][kBlock];       // decode scores / weights
};

Scratch& scratch() {
  thread_local std::unique_ptr<Scratch> mem(new Scratch());
  return *mem;
}

struct Problem {
  const float* q;
  const void* cache;
  const int32_t* page_table;
  const int32_t* positions;
  float* out;
  int64_t batch, tokens, heads, kv_heads, head_dim, page_size, num_pages, pages_per_row;
  int64_t group, tile_tokens, tiles;
  int64_t window;  // 0: full causal attention; w > 0: keys within w positions, self included
  float scale;
};

// The cache row of kv head `kvh` (K if which = 0, V if 1) at `pos`, or null for a bad page.
template <typename T>
const T* kv_row(const Problem& p, const int32_t* table, int64_t kvh, int64_t pos, int which) {
  const int64_t page = table[pos / p.page_size];
  if (page < 0 || page >= p.num_pages) return nullptr;  // the engine never does this; guards memory
  return static_cast<const T*>(p.cache) +
         ((page * p.page_size + pos % p.page_size) * 2 * p.kv_heads + 2 * kvh + which) * p.head_dim;
}

// One query token (decode): rows are its grouped heads, keys are scored by dot products.
template <typename T, int DV>
void attend_token(const Problem& p, int64_t b, int64_t t, int64_t kvh) {
  constexpr int64_t d = DV * kLanes;
  const int64_t g = p.group;
  const int64_t base = ((b * p.tokens + t) * p.heads + kvh * g) * d;
  float* out = p.out + base;
  const int64_t pos = p.positions[b * p.tokens + t];
  if (pos < 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  Scratch& sc = scratch();
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t h = 0; h < g; ++h) {
    for (int dv = 0; dv < DV; ++dv) {
      sc.q[h][dv] = load(p.q + base + h * d + dv * kLanes) * p.scale;
      sc.acc[h][dv] = splat(0.0f);
    }
    m[h] = kNeg;
    l[h] = 0.0f;
  }
  const int32_t* table = p.page_table + b * p.pages_per_row;
  for (int64_t start = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0; start <= pos;) {
    const int64_t n = std::min<int64_t>({pos + 1 - start, p.page_size - start % p.page_size, kBlock});
    const T* k0 = kv_row<T>(p, table, kvh, start, 0);
    start += n;
    if (k0 == nullptr) continue;
    const int64_t stride = 2 * p.kv_heads * d;  // between consecutive positions of a page
    for (int64_t j = 0; j < n; ++j) {
      vf k[DV];
      for (int dv = 0; dv < DV; ++dv) k[dv] = load(k0 + j * stride + dv * kLanes);
      for (int64_t h = 0; h < g; ++h) {
        vf acc = sc.q[h][0] * k[0];
        for (int dv = 1; dv < DV; ++dv) acc += sc.q[h][dv] * k[dv];
        sc.s[h][j] = hsum(acc);
      }
    }
    const T* v0 = k0 + d;
    for (int64_t h = 0; h < g; ++h) {
      vf sv;
      std::memcpy(&sv, sc.s[h], sizeof(sv));
      for (int64_t j = n; j < kBlock; ++j) sv[j] = kNeg;
      const float mx = std::max(m[h], hmax(sv));
      vf e = vexp(sv - mx);
      for (int64_t j = n; j < kBlock; ++j) e[j] = 0.0f;
      const float c = m[h] == mx ? 1.0f : std::exp(m[h] - mx);
      l[h] = l[h] * c + hsum(e);
      m[h] = mx;
      vf acc[DV];
      for (int dv = 0; dv < DV; ++dv) acc[dv] = sc.acc[h][dv] * c;
      for (int64_t j = 0; j < n; ++j)
        for (int dv = 0; dv < DV; ++dv) acc[dv] += e[j] * load(v0 + j * stride + dv * kLanes);
      for (int dv = 0; dv < DV; ++dv) sc.acc[h][dv] = acc[dv];
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    for (int dv = 0; dv < DV; ++dv) {
      const vf o = sc.acc[h][dv] * inv;
      std::memcpy(out + h * d + dv * kLanes, &o, sizeof(o));
    }
  }
}

// A tile of query tokens (prefill): NV vectors of rows, row r = token (r / group), head (r % group).
template <typename T, int DV, int NV>
void attend_tile(const Problem& p, int64_t b, int64_t tile, int64_t kvh) {
  constexpr int64_t d = DV * kLanes;
  const int64_t g = p.group;
  const int64_t t0 = tile * p.tile_tokens;
  const int64_t nt = std::min(p.tile_tokens, p.tokens - t0);
  const int64_t rows = nt * g;
  Scratch& sc = scratch();
  vi qpos[NV];
  vf m[NV], l[NV];
  int64_t maxpos = -1, minpos = INT64_MAX;
  vi qlow[NV];  // a key is attended when qlow < kpos <= qpos
  for (int v = 0; v < NV; ++v) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t r = v * kLanes + lane;
      qpos[v][lane] = r < rows ? p.positions[b * p.tokens + t0 + r / g] : -1;
      qlow[v][lane] = p.window > 0 ? qpos[v][lane] - static_cast<int32_t>(p.window) : -1;
      maxpos = std::max<int64_t>(maxpos, qpos[v][lane]);
      if (qpos[v][lane] >= 0) minpos = std::min<int64_t>(minpos, qpos[v][lane]);
    }
    m[v] = splat(kNeg);
    l[v] = splat(0.0f);
  }
  for (int64_t r = 0; r < NV * kLanes; ++r) {
    const float* qr = r < rows ? p.q + ((b * p.tokens + t0 + r / g) * p.heads + kvh * g + r % g) * d : nullptr;
    for (int64_t i = 0; i < d; ++i) sc.qt[i][r / kLanes][r % kLanes] = qr ? qr[i] * p.scale : 0.0f;
    for (int dv = 0; dv < DV; ++dv) sc.acc[r][dv] = splat(0.0f);
  }
  const int32_t* table = p.page_table + b * p.pages_per_row;
  const int64_t stride = 2 * p.kv_heads * d;
  const int64_t first_key = p.window > 0 && maxpos >= 0 ? std::max<int64_t>(0, minpos - p.window + 1) : 0;
  for (int64_t start = first_key; start <= maxpos;) {
    const int64_t n = std::min<int64_t>({maxpos + 1 - start, p.page_size - start % p.page_size, kBlock});
    const T* k0 = kv_row<T>(p, table, kvh, start, 0);
    const int32_t first = static_cast<int32_t>(start);
    start += n;
    if (k0 == nullptr) continue;
    // Scores, four keys at a time: 4 * NV independent multiply-add chains.
    vf bmax[NV];
    for (int v = 0; v < NV; ++v) bmax[v] = m[v];
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
      const int64_t nk = std::min<int64_t>(4, n - j0);
      vf s[4][NV] = {};
      const T* kp[4];
      for (int kk = 0; kk < 4; ++kk) kp[kk] = k0 + (j0 + std::min<int64_t>(kk, nk - 1)) * stride;
      for (int64_t i = 0; i < d; ++i) {
        const float x0 = to_float(kp[0][i]), x1 = to_float(kp[1][i]), x2 = to_float(kp[2][i]),
                    x3 = to_float(kp[3][i]);
        for (int v = 0; v < NV; ++v) {
          const vf qv = sc.qt[i][v];
          s[0][v] += qv * x0;
          s[1][v] += qv * x1;
          s[2][v] += qv * x2;
          s[3][v] += qv * x3;
        }
      }
      for (int64_t kk = 0; kk < nk; ++kk) {
        const int32_t kpos = first + static_cast<int32_t>(j0 + kk);
        for (int v = 0; v < NV; ++v) {
          const vf sv = (kpos <= qpos[v]) & (kpos > qlow[v]) ? s[kk][v] : splat(kNeg);  // causal, window
          sc.w[j0 + kk][v] = sv;
          bmax[v] = bmax[v] > sv ? bmax[v] : sv;
        }
      }
    }
    vf c[NV];
    for (int v = 0; v < NV; ++v) {
      c[v] = vexp(m[v] - bmax[v]);
      l[v] *= c[v];
      m[v] = bmax[v];
    }
    for (int64_t j = 0; j < n; ++j) {
      const int32_t kpos = first + static_cast<int32_t>(j);
      for (int v = 0; v < NV; ++v) {
        const vf e = (kpos <= qpos[v]) & (kpos > qlow[v]) ? vexp(sc.w[j][v] - m[v]) : splat(0.0f);
        sc.w[j][v] = e;
        l[v] += e;
      }
    }
    // Values, two rows at a time: 2 * DV independent chains.
    const T* v0 = k0 + d;
    for (int64_t r = 0; r < rows; r += 2) {
      const int64_t r1 = std::min(r + 1, rows - 1);
      const float c0 = c[r / kLanes][r % kLanes], c1 = c[r1 / kLanes][r1 % kLanes];
      vf a0[DV], a1[DV];
      for (int dv = 0; dv < DV; ++dv) {
        a0[dv] = sc.acc[r][dv] * c0;
        a1[dv] = sc.acc[r1][dv] * c1;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float w0 = sc.w[j][r / kLanes][r % kLanes], w1 = sc.w[j][r1 / kLanes][r1 % kLanes];
        for (int dv = 0; dv < DV; ++dv) {
          const vf x = load(v0 + j * stride + dv * kLanes);
          a0[dv] += w0 * x;
          a1[dv] += w1 * x;
        }
      }
      for (int dv = 0; dv < DV; ++dv) {
        sc.acc[r1][dv] = a1[dv];
        sc.acc[r][dv] = a0[dv];  // after a1: when r1 == r, a0 is the one to keep
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int v = r / kLanes, lane = r % kLanes;
    float* out = p.out + ((b * p.tokens + t0 + r / g) * p.heads + kvh * g + r % g) * d;
    const float inv = (qpos[v][lane] >= 0 && l[v][lane] > 0.0f) ? 1.0f / l[v][lane] : 0.0f;
    for (int dv = 0; dv < DV; ++dv) {
      const vf o = sc.acc[r][dv] * inv;
      std::memcpy(out + dv * kLanes, &o, sizeof(o));
    }
  }
}

template <typename T, int DV>
void run_item_dv(const Problem& p, int64_t b, int64_t tile, int64_t kvh) {
  if (p.tile_tokens == 1) return attend_token<T, DV>(p, b, tile, kvh);
  const int64_t rows = std::min(p.tile_tokens, p.tokens - tile * p.tile_tokens) * p.group;
  switch ((rows + kLanes - 1) / kLanes) {
    case 1:
      return attend_tile<T, DV, 1>(p, b, tile, kvh);
    case 2:
      return attend_tile<T, DV, 2>(p, b, tile, kvh);
    case 3:
      return attend_tile<T, DV, 3>(p, b, tile, kvh);
    default:
      return attend_tile<T, DV, 4>(p, b, tile, kvh);
  }
}

template <typename T>
void run_item(const Problem& p, int64_t item) {
  const int64_t kvh = item % p.kv_heads;
  const int64_t rest = item / p.kv_heads;
  const int64_t tile = rest % p.tiles, b = rest / p.tiles;
  switch (p.head_dim) {
    case 16:
      return run_item_dv<T, 1>(p, b, tile, kvh);
    case 32:
      return run_item_dv<T, 2>(p, b, tile, kvh);
    case 64:
      return run_item_dv<T, 4>(p, b, tile, kvh);
    case 128:
      return run_item_dv<T, 8>(p, b, tile, kvh);
    default:
      return run_item_dv<T, 16>(p, b, tile, kvh);
  }
}

// Write the chunk's keys and values into their cache slots (padding tokens are skipped).
template <typename T>
void write_chunk(const Problem& p, const float* k, const float* v, void* cache) {
  const int64_t d = p.head_dim, kvh = p.kv_heads;
  for (int64_t bt = 0; bt < p.batch * p.tokens; ++bt) {
    const int64_t pos = p.positions[bt];
    if (pos < 0) continue;
    const int64_t page = p.page_table[(bt / p.tokens) * p.pages_per_row + pos / p.page_size];
    if (page < 0 || page >= p.num_pages) continue;
    T* dst = static_cast<T*>(cache) + (page * p.page_size + pos % p.page_size) * 2 * kvh * d;
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t i = 0; i < d; ++i) {
        from_float(k[(bt * kvh + h) * d + i], dst + (2 * h) * d + i);
        from_float(v[(bt * kvh + h) * d + i], dst + (2 * h + 1) * d + i);
      }
  }
}

// Workers take items from a shared counter. A worker that starts after the work is gone
// touches nothing but the (shared, reference-counted) counters.
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run_items(const Problem& p, bool bf16, Progress& prog, int64_t total) {
  for (;;) {
    const int64_t item = prog.next.fetch_add(1);
    if (item >= total) return;
    if (bf16)
      run_item<uint16_t>(p, item);
    else
      run_item<float>(p, item);
    prog.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::AnyBuffer cache_in, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> positions, float scale, int64_t window, bool share,
                          ffi::ResultBuffer<ffi::F32> out,
                          ffi::Result<ffi::AnyBuffer> cache) {
  const auto qd = q.dimensions();
  const auto cd = cache->dimensions();
  const auto kd = k.dimensions();
  const auto td = page_table.dimensions();
  const auto pd = positions.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || td.size() != 2 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q must be [B,T,H,D], cache [P,S,2*KVH,D], "
                                       "page_table [B,NP], positions [B,T]");
  Problem p;
  p.batch = qd[0];
  p.tokens = qd[1];
  p.heads = qd[2];
  p.head_dim = qd[3];
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.kv_heads = cd[2] / 2;
  p.pages_per_row = td[1];
  p.scale = scale;
  p.window = window;
  if (cd[3] != p.head_dim || cd[2] % 2 != 0 || p.kv_heads == 0 || p.heads % p.kv_heads != 0 ||
      td[0] != p.batch || pd[0] != p.batch || pd[1] != p.tokens || kd.size() != 4 || kd[0] != p.batch ||
      kd[1] != p.tokens || kd[2] != p.kv_heads || kd[3] != p.head_dim || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  if (cache->untyped_data() != cache_in.untyped_data())
    return ffi::Error::InvalidArgument("paged attention: the cache output must alias the cache input");
  p.group = p.heads / p.kv_heads;
  if (p.group > kMaxGroup)
    return ffi::Error::InvalidArgument("paged attention: at most 64 query heads per kv head");
  if (p.head_dim != 16 && p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return ffi::Error::InvalidArgument("paged attention: head_dim must be 16, 32, 64, 128 or 256");
  const bool bf16 = cache->element_type() == ffi::DataType::BF16;
  if (!bf16 && cache->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged attention: the cache must be float32 or bfloat16");
  const int64_t capacity = p.pages_per_row * p.page_size;
  for (int64_t i = 0; i < p.batch * p.tokens; ++i)
    if (positions.typed_data()[i] >= capacity)
      return ffi::Error::InvalidArgument("paged attention: a position lies past the pages given");
  p.tile_tokens = p.tokens == 1 ? 1 : std::max<int64_t>(1, std::min<int64_t>(p.tokens, kTileRows / p.group));
  if (p.tile_tokens * p.group > kMaxNV * kLanes) p.tile_tokens = 1;
  p.tiles = (p.tokens + p.tile_tokens - 1) / p.tile_tokens;
  p.q = q.typed_data();
  p.cache = cache->untyped_data();
  p.page_table = page_table.typed_data();
  p.positions = positions.typed_data();
  p.out = out->typed_data();

  if (bf16)
    write_chunk<uint16_t>(p, k.typed_data(), v.typed_data(), cache->untyped_data());
  else
    write_chunk<float>(p, k.typed_data(), v.typed_data(), cache->untyped_data());

  const int64_t total = p.batch * p.tiles * p.kv_heads;
  auto prog = std::make_shared<Progress>();
  // `share` false (a multi-device mesh, whose devices already keep every core busy, and whose
  // collectives block pool threads): the calling thread does every item itself.
  const int64_t helpers = share ? std::min<int64_t>(pool.num_threads(), total) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) {
    // `p` is copied; its pointers are used only while items remain, i.e. before we return.
    pool.Schedule([prog, p, bf16, total] { run_items(p, bf16, *prog, total); });
  }
  run_items(p, bf16, *prog, total);
  while (prog->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::AnyBuffer>()         // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")  // 0: full causal attention
                                  .Attr<bool>("share")      // share the items with the intra-op pool
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>());       // cache, updated in place
