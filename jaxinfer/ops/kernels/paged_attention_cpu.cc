// Causal attention over the paged KV cache, for XLA's CPU backend (an XLA FFI handler).
//
// XLA lowers the page gather of the pure-JAX path to an element-by-element copy, and that
// gather, with the masked softmax over the gathered copy, was most of a batched CPU step.
// This kernel reads each request's pages where they lie, in page-sized blocks, with an
// online softmax, so the context is read once and never copied.
//
// The batch is ragged (jaxinfer/ops/gather_attention.py, RaggedMetadata): every token of every
// request in one flat list, request r owning tokens query_start[r] .. query_start[r+1]-1. A
// decode row is a request with one token, a prefill chunk a request with many.
//
// Layout (see jaxinfer/ops/kv_cache.py): cache [num_pages, page_size, 2*KVH, D] with K at even and
// V at odd head indices. The kernel first writes the step's own keys/values into their slots
// (the cache is an input aliased to an output, so the write is in place), then attends.
//
//   q           [N, H, D]        float32   queries (RoPE applied)
//   k, v        [N, KVH, D]      float32   the tokens' keys (RoPE applied) and values
//   cache       [P, S, 2*KVH, D]           float32 or bfloat16 (rounded to nearest even)
//   page_table  [R, NP]          int32     pages of each request, in order
//   positions   [N]              int32     position of each token; -1: padding (not written,
//                                          output zeros)
//   query_start [R + 1]          int32     token offsets of the requests (non-decreasing; tokens
//                                          outside every segment are padding: output zeros)
//   out         [N, H, D]        float32;  cache_out: the cache, updated (aliases `cache`)
//
// A token at position p attends keys 0..p of its request (causal; grouped-query heads share
// their kv head); with the `window` attribute w > 0, only keys p-w+1..p (sliding window: the
// blocks before a token's window are never read, so those pages may be gone). Work items are
// (request, kv head, tile of that request's query tokens), shared with XLA's intra-op thread
// pool; a decode row is a tile of one token. Keys and values are read from the cache a vector (16 elements of head_dim) at a
// time, converted from bfloat16 on the fly.
//
// One order per output element, whatever else is computed with it. A query row's output is
// bitwise the same in a decode step, anywhere in a prefill chunk of any size, beside any other
// rows, requests or padding, and whichever thread runs it: every row is computed on its own
// by the one routine (`attend_rows`), and nothing in it depends on the other rows of its item:
//   * keys come in blocks fixed by absolute position (every kBlock positions from 0, split at
//     page boundaries), never by where a chunk or window starts;
//   * each score q.k is `dot`: lane i sums elements i, i+16, ... in order, then a fixed tree;
//   * per block: the max, exp of the scores less it, the tree sum of the weights, one rescale
//     of the running sum and the accumulators; keys outside the row's range (causal, window)
//     are masked out of the max and the sum and never touch the accumulators;
//   * values are added to each row in key order, one multiply-add per key; the output is the
//     accumulator times 1 / sum.
// tests/test_attention_invariance.py checks it bitwise.
// head_dim must be 16, 32, 64, 128 or 256 (Gemma 3) (jaxinfer/ops/attention.py checks before calling).
//
// A second handler, for multi-head latent attention over a latent cache (`LatentAttention`, FFI target
// jaxinfer_latent_attention), follows the same scheme; it is described where it begins below.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

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
constexpr int kMaxRows = 64;      // query rows per work item (one token of kMaxGroup heads)
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

// One row's online-softmax step over a block of up to 16 scores ``s`` (keys jlo .. jhi - 1 of it count):
// the running max ``m`` and sum ``l`` move on, ``s`` becomes the block's weights (zero outside), and the
// factor the row's accumulator must be rescaled by is returned (1 when the max did not move). Both kernels,
// GQA and latent, take this one step, so they round alike.
inline float softmax_block(float* s, int64_t jlo, int64_t jhi, float& m, float& l) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vi in = (lane >= static_cast<int32_t>(jlo)) & (lane < static_cast<int32_t>(jhi));
  vf sv;
  std::memcpy(&sv, s, sizeof(sv));
  sv = in ? sv : splat(kNeg);
  const float mx = std::max(m, hmax(sv));
  vf e = vexp(sv - mx);
  e = in ? e : splat(0.0f);
  const float c = m == mx ? 1.0f : std::exp(m - mx);
  l = l * c + hsum(e);
  m = mx;
  std::memcpy(s, &e, sizeof(e));
  return c;
}

// Per-thread working memory (kept off the stack).
struct Scratch {
  vf q[kMaxRows][kMaxDV];    // the item's query rows, scaled
  vf acc[kMaxRows][kMaxDV];  // output accumulators, one per query row
  float s[kMaxRows][kBlock]; // scores, then softmax weights, of the current key block
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
  const int32_t* query_start;
  const int64_t* items;  // per work item (before the kv head): request * 2^32 + first token
  float* out;
  int64_t tokens, requests, heads, kv_heads, head_dim, page_size, num_pages, pages_per_row;
  int64_t group, tile_tokens, num_items;
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

// Key blocks are fixed by absolute positions: boundaries at every multiple of kBlock and at every
// page boundary. A query row meets the same blocks, holding its keys in the same slots, whatever
// chunk, tile or step it is computed in.
inline int64_t block_start(int64_t pos, int64_t page_size) {
  return std::max(pos - pos % kBlock, pos - pos % page_size);
}
inline int64_t block_end(int64_t start, int64_t page_size) {
  return std::min(start - start % kBlock + kBlock, start - start % page_size + page_size);
}

// q.k of one query row and one key: lane i sums elements i, i + 16, ... in order, then the
// fixed halving tree of hsum. The one order of every score, in decode and prefill alike.
template <int DV>
inline float dot(const vf* q, const vf* k) {
  vf acc = q[0] * k[0];
  for (int dv = 1; dv < DV; ++dv) acc += q[dv] * k[dv];
  return hsum(acc);
}

// acc += w[j] * v[j] for keys j0 <= j < j1, in order of j (one row, or two rows sharing the loads).
template <typename T, int DV>
inline void add_values(vf* acc, const float* w, const T* v0, int64_t stride, int64_t j0, int64_t j1) {
  if (j0 >= j1) return;
  vf a[DV];
  for (int dv = 0; dv < DV; ++dv) a[dv] = acc[dv];
  for (int64_t j = j0; j < j1; ++j) {
    const float wj = w[j];
    for (int dv = 0; dv < DV; ++dv) a[dv] += wj * load(v0 + j * stride + dv * kLanes);
  }
  for (int dv = 0; dv < DV; ++dv) acc[dv] = a[dv];
}

template <typename T, int DV>
inline void add_values2(vf* acc0, const float* w0, vf* acc1, const float* w1, const T* v0, int64_t stride,
                        int64_t j0, int64_t j1) {
  if (j0 >= j1) return;
  vf a0[DV], a1[DV];
  for (int dv = 0; dv < DV; ++dv) {
    a0[dv] = acc0[dv];
    a1[dv] = acc1[dv];
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float x0 = w0[j], x1 = w1[j];
    for (int dv = 0; dv < DV; ++dv) {
      const vf x = load(v0 + j * stride + dv * kLanes);
      a0[dv] += x0 * x;
      a1[dv] += x1 * x;
    }
  }
  for (int dv = 0; dv < DV; ++dv) {
    acc0[dv] = a0[dv];
    acc1[dv] = a1[dv];
  }
}

// A work item: query rows (tokens t0 .. t0 + nt - 1 of request b, x the kv head's grouped heads;
// a decode row is one token). Every row is computed on its own, in the same order whatever the
// other rows of the item are: its keys, in absolute blocks; per block its scores by `dot`, the
// block max, exp, the halving-tree sum of the weights, one rescale; its values in key order.
// Keys outside a row's range (causal, window) never touch its sums.
template <typename T, int DV>
void attend_rows(const Problem& p, int64_t b, int64_t t0, int64_t kvh) {
  constexpr int64_t d = DV * kLanes;
  const int64_t g = p.group;
  const int64_t rows = std::min<int64_t>(p.tile_tokens, p.query_start[b + 1] - t0) * g;
  Scratch& sc = scratch();
  int64_t lo[kMaxRows], hi[kMaxRows];  // row r attends keys lo[r] <= pos < hi[r]
  float m[kMaxRows], l[kMaxRows];
  int64_t first = INT64_MAX, last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bt = t0 + r / g;
    const int64_t pos = p.positions[bt];
    lo[r] = pos < 0 ? 0 : p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    hi[r] = pos < 0 ? 0 : pos + 1;
    if (hi[r] > lo[r]) {
      first = std::min(first, lo[r]);
      last = std::max(last, hi[r]);
    }
    const float* qr = p.q + (bt * p.heads + kvh * g + r % g) * d;
    for (int dv = 0; dv < DV; ++dv) {
      sc.q[r][dv] = load(qr + dv * kLanes) * p.scale;
      sc.acc[r][dv] = splat(0.0f);
    }
    m[r] = kNeg;
    l[r] = 0.0f;
  }
  const int32_t* table = p.page_table + b * p.pages_per_row;
  const int64_t stride = 2 * p.kv_heads * d;  // between consecutive positions of a page
  int64_t jlo[kMaxRows], jhi[kMaxRows];
  for (int64_t start = first < last ? block_start(first, p.page_size) : last; start < last;) {
    const int64_t bs = start, n = std::min(block_end(start, p.page_size), last) - start;
    start += n;
    const T* k0 = kv_row<T>(p, table, kvh, bs, 0);
    if (k0 == nullptr) continue;
    for (int64_t j = 0; j < n; ++j) {
      vf k[DV];
      for (int dv = 0; dv < DV; ++dv) k[dv] = load(k0 + j * stride + dv * kLanes);
      for (int64_t r = 0; r < rows; ++r) sc.s[r][j] = dot<DV>(sc.q[r], k);
    }
    for (int64_t r = 0; r < rows; ++r) {
      jlo[r] = std::max<int64_t>(lo[r] - bs, 0);
      jhi[r] = std::min<int64_t>(hi[r] - bs, n);
      if (jlo[r] >= jhi[r]) continue;  // no key of this block for this row
      const float c = softmax_block(sc.s[r], jlo[r], jhi[r], m[r], l[r]);
      if (c != 1.0f)
        for (int dv = 0; dv < DV; ++dv) sc.acc[r][dv] = sc.acc[r][dv] * c;
    }
    // The rescaled accumulators go through memory: no multiply-add may fuse the rescale into
    // the first value of the block in one loop and not in another.
    asm volatile("" ::: "memory");
    const T* v0 = k0 + d;
    for (int64_t r = 0; r < rows; r += 2) {
      if (r + 1 == rows) {
        add_values<T, DV>(sc.acc[r], sc.s[r], v0, stride, jlo[r], jhi[r]);
        break;
      }
      const int64_t r1 = r + 1;
      const int64_t a = std::max(jlo[r], jlo[r1]), z = std::min(jhi[r], jhi[r1]);
      if (a >= z) {  // disjoint ranges: one row at a time
        add_values<T, DV>(sc.acc[r], sc.s[r], v0, stride, jlo[r], jhi[r]);
        add_values<T, DV>(sc.acc[r1], sc.s[r1], v0, stride, jlo[r1], jhi[r1]);
        continue;
      }
      // each row's keys stay in order: its part before the shared range, the shared range, after
      add_values<T, DV>(sc.acc[r], sc.s[r], v0, stride, jlo[r], a);
      add_values<T, DV>(sc.acc[r1], sc.s[r1], v0, stride, jlo[r1], a);
      add_values2<T, DV>(sc.acc[r], sc.s[r], sc.acc[r1], sc.s[r1], v0, stride, a, z);
      add_values<T, DV>(sc.acc[r], sc.s[r], v0, stride, z, jhi[r]);
      add_values<T, DV>(sc.acc[r1], sc.s[r1], v0, stride, z, jhi[r1]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.out + ((t0 + r / g) * p.heads + kvh * g + r % g) * d;
    const float inv = (hi[r] > lo[r] && l[r] > 0.0f) ? 1.0f / l[r] : 0.0f;
    for (int dv = 0; dv < DV; ++dv) {
      const vf o = sc.acc[r][dv] * inv;
      std::memcpy(out + dv * kLanes, &o, sizeof(o));
    }
  }
}

template <typename T>
void run_item(const Problem& p, int64_t item) {
  const int64_t kvh = item % p.kv_heads;
  const int64_t packed = p.items[item / p.kv_heads];
  const int64_t b = packed >> 32, tile = packed & 0xffffffffLL;  // tile: the item's first token
  switch (p.head_dim) {
    case 16:
      return attend_rows<T, 1>(p, b, tile, kvh);
    case 32:
      return attend_rows<T, 2>(p, b, tile, kvh);
    case 64:
      return attend_rows<T, 4>(p, b, tile, kvh);
    case 128:
      return attend_rows<T, 8>(p, b, tile, kvh);
    default:
      return attend_rows<T, 16>(p, b, tile, kvh);
  }
}

// Write the step's keys and values into their cache slots (padding tokens are skipped).
template <typename T>
void write_tokens(const Problem& p, const float* k, const float* v, void* cache) {
  const int64_t d = p.head_dim, kvh = p.kv_heads;
  for (int64_t b = 0; b < p.requests; ++b)
    for (int64_t bt = p.query_start[b]; bt < p.query_start[b + 1]; ++bt) {
      const int64_t pos = p.positions[bt];
      if (pos < 0) continue;
      const int64_t page = p.page_table[b * p.pages_per_row + pos / p.page_size];
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

// What both kernels check of a step's segments: query_start within 0 .. the token count and not decreasing,
// every real token's position inside its request's pages. `who` names the kernel in the error.
ffi::Error check_segments(const std::string& who, const int32_t* qs, const int32_t* positions, int64_t requests,
                          int64_t tokens, int64_t capacity) {
  if (qs[0] < 0 || qs[requests] > tokens)
    return ffi::Error::InvalidArgument(who + ": query_start must lie within 0 .. the token count");
  for (int64_t b = 0; b < requests; ++b)
    if (qs[b + 1] < qs[b]) return ffi::Error::InvalidArgument(who + ": query_start must not decrease");
  for (int64_t i = qs[0]; i < qs[requests]; ++i)
    if (positions[i] >= capacity) return ffi::Error::InvalidArgument(who + ": a position lies past the pages given");
  return ffi::Error::Success();
}

// Tokens outside every request's segment are padding: their output rows (`row` floats each) are zeros (a
// segment's own padding tokens come out as zeros from the row routines, which give them no keys).
void zero_padding(float* out, const int32_t* qs, int64_t requests, int64_t tokens, int64_t row) {
  std::memset(out, 0, sizeof(float) * qs[0] * row);
  std::memset(out + qs[requests] * row, 0, sizeof(float) * (tokens - qs[requests]) * row);
}

// The work items of both kernels, before their head split: (request << 32 | the first token of a tile of
// `tile` tokens of its segment), request by request.
std::shared_ptr<std::vector<int64_t>> tile_items(const int32_t* qs, int64_t requests, int64_t tokens, int64_t tile) {
  auto items = std::make_shared<std::vector<int64_t>>();
  items->reserve(requests + tokens / tile + 1);
  for (int64_t b = 0; b < requests; ++b)
    for (int64_t t = qs[b]; t < qs[b + 1]; t += tile) items->push_back((b << 32) | t);
  return items;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::AnyBuffer cache_in, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> query_start, float scale,
                          int64_t window, bool share, ffi::ResultBuffer<ffi::F32> out,
                          ffi::Result<ffi::AnyBuffer> cache) {
  const auto qd = q.dimensions();
  const auto cd = cache->dimensions();
  const auto kd = k.dimensions();
  const auto td = page_table.dimensions();
  const auto pd = positions.dimensions();
  const auto sd = query_start.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || pd.size() != 1 || sd.size() != 1)
    return ffi::Error::InvalidArgument("paged attention: q must be [N,H,D], cache [P,S,2*KVH,D], "
                                       "page_table [R,NP], positions [N], query_start [R+1]");
  Problem p;
  p.tokens = qd[0];
  p.heads = qd[1];
  p.head_dim = qd[2];
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.kv_heads = cd[2] / 2;
  p.requests = td[0];
  p.pages_per_row = td[1];
  p.scale = scale;
  p.window = window;
  if (cd[3] != p.head_dim || cd[2] % 2 != 0 || p.kv_heads == 0 || p.heads % p.kv_heads != 0 ||
      pd[0] != p.tokens || sd[0] != p.requests + 1 || kd.size() != 3 || kd[0] != p.tokens ||
      kd[1] != p.kv_heads || kd[2] != p.head_dim || v.element_count() != k.element_count())
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
  const int32_t* qs = query_start.typed_data();
  ffi::Error segments = check_segments("paged attention", qs, positions.typed_data(), p.requests, p.tokens,
                                       p.pages_per_row * p.page_size);
  if (segments.failure()) return segments;
  p.tile_tokens = std::max<int64_t>(1, kTileRows / p.group);
  p.q = q.typed_data();
  p.cache = cache->untyped_data();
  p.page_table = page_table.typed_data();
  p.positions = positions.typed_data();
  p.query_start = qs;
  p.out = out->typed_data();

  zero_padding(p.out, qs, p.requests, p.tokens, p.heads * p.head_dim);
  auto items = tile_items(qs, p.requests, p.tokens, p.tile_tokens);  // then each kv head of each
  p.items = items->data();
  p.num_items = static_cast<int64_t>(items->size());

  if (bf16)
    write_tokens<uint16_t>(p, k.typed_data(), v.typed_data(), cache->untyped_data());
  else
    write_tokens<float>(p, k.typed_data(), v.typed_data(), cache->untyped_data());

  const int64_t total = p.num_items * p.kv_heads;
  auto prog = std::make_shared<Progress>();
  // `share` false (a multi-device mesh, whose devices already keep every core busy, and whose
  // collectives block pool threads): the calling thread does every item itself.
  const int64_t helpers = share ? std::min<int64_t>(pool.num_threads(), total) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) {
    // `p` is copied; its pointers (and `items`, kept alive by the lambda) are used only while
    // items remain, i.e. before we return.
    pool.Schedule([prog, items, p, bf16, total] { run_items(p, bf16, *prog, total); });
  }
  run_items(p, bf16, *prog, total);
  while (prog->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Multi-head latent attention (DeepSeek's MLA in its absorbed form) over a latent cache: one entry
// of D values per token (the latent, then the rotary key), shared by every query head: each head's
// key is the whole entry, its value the entry's first value_dim values.
//
//   q           [N, H, D]        float32   queries (the latent's up-projection folded in, RoPE applied)
//   entry       [N, 1, D]        float32   the tokens' entries, written to their slots first
//   cache       [P, S, 1, D]               float32 or bfloat16 (rounded to nearest even)
//   page_table, positions, query_start: as above
//   out         [N, H, value_dim] float32; cache_out: the cache, updated (aliases `cache`)
//
// D and value_dim are runtime sizes, multiples of 8 (value_dim <= D <= kLatentMaxDim). The same
// scheme as the grouped-query kernel: work items are (request, group of heads, tile of the request's
// query tokens) on the same shared counter; every row (token x head) is computed on its own by one
// routine with one order per output element, whatever rows share its item, so a token's output is
// bitwise the same in a decode step, anywhere in a prefill chunk, beside any other requests:
//   * key blocks at absolute positions (`block_start` / `block_end`);
//   * each score q.k: two 8-lane accumulators, even and odd vectors of D in order, added, then the
//     fixed halving tree (computed for four rows at once sharing the key loads, or for one: the same
//     operations per row);
//   * per block the softmax steps of `attend_rows`;
//   * values added to each row in key order, one multiply-add per key and element.
// How many heads an item takes follows the step (so a decode step of one request still splits over
// the threads); no row depends on it. tests/test_latent_attention_kernel.py checks it bitwise.

constexpr int kLanes8 = 8;
typedef float vf8 __attribute__((vector_size(kLanes8 * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(kLanes8 * sizeof(int32_t))));
typedef uint16_t vh8 __attribute__((vector_size(kLanes8 * sizeof(uint16_t))));

constexpr int64_t kLatentMaxDim = 1024;  // D, at most
constexpr int64_t kLatentMaxHeads = 32;  // heads per work item, at most
constexpr int64_t kLatentTileRows = 48;  // target query rows (tokens x heads) per prefill tile
constexpr int64_t kLatentMaxRows = 64;

inline vf8 load8(const float* p) {
  vf8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline vf8 load8(const uint16_t* p) {
  vh8 h;
  std::memcpy(&h, p, sizeof(h));
  vi8 bits = __builtin_convertvector(h, vi8) << 16;
  vf8 x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline float hsum8(vf8 x) {  // the fixed halving tree
#if defined(__clang__)
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  x += __builtin_shuffle(x, vi8{4, 5, 6, 7, 0, 1, 2, 3});
  x += __builtin_shuffle(x, vi8{2, 3, 0, 1, 6, 7, 4, 5});
  x += __builtin_shuffle(x, vi8{1, 0, 3, 2, 5, 4, 7, 6});
#endif
  return x[0];
}

struct LatentScratch {
  std::vector<vf8> q;    // [rows][D / 8], scaled
  std::vector<vf8> acc;  // [rows][value_dim / 8]
  float s[kLatentMaxRows][kBlock];
};

LatentScratch& latent_scratch() {
  thread_local std::unique_ptr<LatentScratch> mem(new LatentScratch());
  return *mem;
}

struct LatentProblem {
  const float* q;
  const void* cache;
  const int32_t* page_table;
  const int32_t* positions;
  const int32_t* query_start;
  const int64_t* items;  // per work item (before the head group): request * 2^32 + first token
  float* out;
  int64_t tokens, requests, heads, dim, value_dim, page_size, num_pages, pages_per_row;
  int64_t group_heads, head_groups, tile_tokens, num_items;
  float scale;
};

// Scores of R query rows (q[r], d8 vectors each) against one key: per row two accumulators, even and
// odd vectors in order, their sum, then the halving tree. R = 4 shares each key load among four rows;
// every row's operations are those of R = 1.
template <typename T, int R>
inline void latent_dots(const vf8* const* q, const T* k, int64_t d8, float* const* s, int64_t j) {
  vf8 a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = vf8{};
  int64_t dv = 0;
  for (; dv + 1 < d8; dv += 2) {
    const vf8 k0 = load8(k + dv * kLanes8), k1 = load8(k + (dv + 1) * kLanes8);
    for (int r = 0; r < R; ++r) {
      a[r] += q[r][dv] * k0;
      b[r] += q[r][dv + 1] * k1;
    }
  }
  if (dv < d8) {
    const vf8 k0 = load8(k + dv * kLanes8);
    for (int r = 0; r < R; ++r) a[r] += q[r][dv] * k0;
  }
  for (int r = 0; r < R; ++r) s[r][j] = hsum8(a[r] + b[r]);
}

// acc[r] += w[r][j] * v[j] for keys j0 <= j < j1 in order of j, for R rows sharing the value loads,
// four vectors of value_dim at a time (then one at a time for the rest).
template <typename T, int R>
inline void latent_values(vf8* const* acc, const float* const* w, const T* v0, int64_t stride, int64_t j0,
                          int64_t j1, int64_t v8) {
  if (j0 >= j1) return;
  int64_t c = 0;
  for (; c + 4 <= v8; c += 4) {
    vf8 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) a[r][u] = acc[r][c + u];
    for (int64_t j = j0; j < j1; ++j) {
      const T* v = v0 + j * stride + c * kLanes8;
      const vf8 x0 = load8(v), x1 = load8(v + kLanes8), x2 = load8(v + 2 * kLanes8), x3 = load8(v + 3 * kLanes8);
      for (int r = 0; r < R; ++r) {
        const float wj = w[r][j];
        a[r][0] += wj * x0;
        a[r][1] += wj * x1;
        a[r][2] += wj * x2;
        a[r][3] += wj * x3;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][c + u] = a[r][u];
  }
  for (; c < v8; ++c) {
    vf8 a[R];
    for (int r = 0; r < R; ++r) a[r] = acc[r][c];
    for (int64_t j = j0; j < j1; ++j) {
      const vf8 x = load8(v0 + j * stride + c * kLanes8);
      for (int r = 0; r < R; ++r) a[r] += w[r][j] * x;
    }
    for (int r = 0; r < R; ++r) acc[r][c] = a[r];
  }
}

template <typename T>
void latent_rows(const LatentProblem& p, int64_t b, int64_t t0, int64_t hg) {
  const int64_t d8 = p.dim / kLanes8, v8 = p.value_dim / kLanes8;
  const int64_t h0 = hg * p.group_heads, hn = std::min(p.group_heads, p.heads - h0);
  const int64_t rows = std::min<int64_t>(p.tile_tokens, p.query_start[b + 1] - t0) * hn;
  LatentScratch& sc = latent_scratch();
  if (static_cast<int64_t>(sc.q.size()) < rows * d8) sc.q.resize(rows * d8);
  if (static_cast<int64_t>(sc.acc.size()) < rows * v8) sc.acc.resize(rows * v8);
  vf8* qs[kLatentMaxRows];
  vf8* accs[kLatentMaxRows];
  float* ss[kLatentMaxRows];
  int64_t lo[kLatentMaxRows], hi[kLatentMaxRows];
  float m[kLatentMaxRows], l[kLatentMaxRows];
  int64_t first = INT64_MAX, last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bt = t0 + r / hn;
    const int64_t pos = p.positions[bt];
    lo[r] = 0;
    hi[r] = pos < 0 ? 0 : pos + 1;
    if (hi[r] > lo[r]) {
      first = std::min(first, lo[r]);
      last = std::max(last, hi[r]);
    }
    qs[r] = sc.q.data() + r * d8;
    accs[r] = sc.acc.data() + r * v8;
    ss[r] = sc.s[r];
    const float* qr = p.q + (bt * p.heads + h0 + r % hn) * p.dim;
    for (int64_t dv = 0; dv < d8; ++dv) qs[r][dv] = load8(qr + dv * kLanes8) * p.scale;
    for (int64_t dv = 0; dv < v8; ++dv) accs[r][dv] = vf8{};
    m[r] = kNeg;
    l[r] = 0.0f;
  }
  const int32_t* table = p.page_table + b * p.pages_per_row;
  const int64_t stride = p.dim;  // between consecutive positions of a page
  int64_t jlo[kLatentMaxRows], jhi[kLatentMaxRows];
  for (int64_t start = first < last ? block_start(first, p.page_size) : last; start < last;) {
    const int64_t bs = start, n = std::min(block_end(start, p.page_size), last) - start;
    start += n;
    const int64_t page = table[bs / p.page_size];
    if (page < 0 || page >= p.num_pages) continue;  // the engine never does this; guards memory
    const T* k0 = static_cast<const T*>(p.cache) + (page * p.page_size + bs % p.page_size) * stride;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      for (int64_t j = 0; j < n; ++j) latent_dots<T, 4>(qs + r, k0 + j * stride, d8, ss + r, j);
    for (; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) latent_dots<T, 1>(qs + r, k0 + j * stride, d8, ss + r, j);
    for (r = 0; r < rows; ++r) {
      jlo[r] = std::max<int64_t>(lo[r] - bs, 0);
      jhi[r] = std::min<int64_t>(hi[r] - bs, n);
      if (jlo[r] >= jhi[r]) continue;  // no key of this block for this row
      const float c = softmax_block(sc.s[r], jlo[r], jhi[r], m[r], l[r]);
      if (c != 1.0f)
        for (int64_t dv = 0; dv < v8; ++dv) accs[r][dv] = accs[r][dv] * c;
    }
    asm volatile("" ::: "memory");  // as in `attend_rows`: the rescale never fuses into an add
    for (r = 0; r < rows; r += 2) {
      if (r + 1 == rows) {
        latent_values<T, 1>(accs + r, ss + r, k0, stride, jlo[r], jhi[r], v8);
        break;
      }
      const int64_t r1 = r + 1;
      const int64_t a = std::max(jlo[r], jlo[r1]), z = std::min(jhi[r], jhi[r1]);
      if (a >= z) {
        latent_values<T, 1>(accs + r, ss + r, k0, stride, jlo[r], jhi[r], v8);
        latent_values<T, 1>(accs + r1, ss + r1, k0, stride, jlo[r1], jhi[r1], v8);
        continue;
      }
      latent_values<T, 1>(accs + r, ss + r, k0, stride, jlo[r], a, v8);
      latent_values<T, 1>(accs + r1, ss + r1, k0, stride, jlo[r1], a, v8);
      latent_values<T, 2>(accs + r, ss + r, k0, stride, a, z, v8);
      latent_values<T, 1>(accs + r, ss + r, k0, stride, z, jhi[r], v8);
      latent_values<T, 1>(accs + r1, ss + r1, k0, stride, z, jhi[r1], v8);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.out + ((t0 + r / hn) * p.heads + h0 + r % hn) * p.value_dim;
    const float inv = (hi[r] > lo[r] && l[r] > 0.0f) ? 1.0f / l[r] : 0.0f;
    for (int64_t dv = 0; dv < v8; ++dv) {
      const vf8 o = accs[r][dv] * inv;
      std::memcpy(out + dv * kLanes8, &o, sizeof(o));
    }
  }
}

template <typename T>
void write_entries(const LatentProblem& p, const float* entry, void* cache) {
  const int64_t d = p.dim;
  for (int64_t b = 0; b < p.requests; ++b)
    for (int64_t bt = p.query_start[b]; bt < p.query_start[b + 1]; ++bt) {
      const int64_t pos = p.positions[bt];
      if (pos < 0) continue;
      const int64_t page = p.page_table[b * p.pages_per_row + pos / p.page_size];
      if (page < 0 || page >= p.num_pages) continue;
      T* dst = static_cast<T*>(cache) + (page * p.page_size + pos % p.page_size) * d;
      for (int64_t i = 0; i < d; ++i) from_float(entry[bt * d + i], dst + i);
    }
}

void run_latent_items(const LatentProblem& p, bool bf16, Progress& prog, int64_t total) {
  for (;;) {
    const int64_t item = prog.next.fetch_add(1);
    if (item >= total) return;
    const int64_t hg = item % p.head_groups;
    const int64_t packed = p.items[item / p.head_groups];
    const int64_t b = packed >> 32, t0 = packed & 0xffffffffLL;
    if (bf16)
      latent_rows<uint16_t>(p, b, t0, hg);
    else
      latent_rows<float>(p, b, t0, hg);
    prog.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error LatentAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> entry,
                           ffi::AnyBuffer cache_in, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> query_start, float scale, int64_t value_dim, bool share,
                           ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> cache) {
  const auto qd = q.dimensions();
  const auto cd = cache->dimensions();
  const auto ed = entry.dimensions();
  const auto td = page_table.dimensions();
  const auto pd = positions.dimensions();
  const auto sd = query_start.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 3 || ed.size() != 3 || cd.size() != 4 || td.size() != 2 || pd.size() != 1 || sd.size() != 1 ||
      od.size() != 3)
    return ffi::Error::InvalidArgument("latent attention: q must be [N,H,D], entry [N,1,D], cache [P,S,1,D], "
                                       "page_table [R,NP], positions [N], query_start [R+1], out [N,H,value_dim]");
  LatentProblem p;
  p.tokens = qd[0];
  p.heads = qd[1];
  p.dim = qd[2];
  p.value_dim = value_dim;
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.requests = td[0];
  p.pages_per_row = td[1];
  p.scale = scale;
  if (cd[2] != 1 || cd[3] != p.dim || ed[0] != p.tokens || ed[1] != 1 || ed[2] != p.dim || pd[0] != p.tokens ||
      sd[0] != p.requests + 1 || od[0] != p.tokens || od[1] != p.heads || od[2] != value_dim || p.heads < 1)
    return ffi::Error::InvalidArgument("latent attention: shapes do not agree");
  if (cache->untyped_data() != cache_in.untyped_data())
    return ffi::Error::InvalidArgument("latent attention: the cache output must alias the cache input");
  if (p.dim % kLanes8 != 0 || p.dim > kLatentMaxDim)
    return ffi::Error::InvalidArgument("latent attention: the entry's size D must be a multiple of 8, at most 1024");
  if (value_dim % kLanes8 != 0 || value_dim < kLanes8 || value_dim > p.dim)
    return ffi::Error::InvalidArgument("latent attention: value_dim must be a multiple of 8, 8 .. D");
  const bool bf16 = cache->element_type() == ffi::DataType::BF16;
  if (!bf16 && cache->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("latent attention: the cache must be float32 or bfloat16");
  const int32_t* qs = query_start.typed_data();
  ffi::Error segments = check_segments("latent attention", qs, positions.typed_data(), p.requests, p.tokens,
                                       p.pages_per_row * p.page_size);
  if (segments.failure()) return segments;
  int64_t active = 0;  // requests with tokens in this step
  for (int64_t b = 0; b < p.requests; ++b) active += qs[b + 1] > qs[b];
  // Heads per item: at most kLatentMaxHeads; fewer (down to 4) when the step has fewer requests than
  // threads, so a small decode step still splits over the pool. No row's result depends on it.
  const int64_t threads = share ? std::max<int64_t>(1, pool.num_threads()) : 1;
  int64_t groups = (p.heads + kLatentMaxHeads - 1) / kLatentMaxHeads;
  while (active * groups < threads && (p.heads + 2 * groups - 1) / (2 * groups) >= 4) groups *= 2;
  p.group_heads = (p.heads + groups - 1) / groups;
  p.head_groups = (p.heads + p.group_heads - 1) / p.group_heads;
  p.tile_tokens = std::max<int64_t>(1, kLatentTileRows / p.group_heads);
  p.q = q.typed_data();
  p.cache = cache->untyped_data();
  p.page_table = page_table.typed_data();
  p.positions = positions.typed_data();
  p.query_start = qs;
  p.out = out->typed_data();

  zero_padding(p.out, qs, p.requests, p.tokens, p.heads * p.value_dim);
  auto items = tile_items(qs, p.requests, p.tokens, p.tile_tokens);  // then each group of heads of each
  p.items = items->data();
  p.num_items = static_cast<int64_t>(items->size());

  if (bf16)
    write_entries<uint16_t>(p, entry.typed_data(), cache->untyped_data());
  else
    write_entries<float>(p, entry.typed_data(), cache->untyped_data());

  const int64_t total = p.num_items * p.head_groups;
  auto prog = std::make_shared<Progress>();
  const int64_t helpers = share ? std::min<int64_t>(pool.num_threads(), total) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([prog, items, p, bf16, total] { run_latent_items(p, bf16, *prog, total); });
  run_latent_items(p, bf16, *prog, total);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")  // 0: full causal attention
                                  .Attr<bool>("share")      // share the items with the intra-op pool
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>());       // cache, updated in place

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferLatentAttention, LatentAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // entry
                                  .Arg<ffi::AnyBuffer>()         // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("value_dim")
                                  .Attr<bool>("share")           // share the items with the intra-op pool
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [N, H, value_dim]
                                  .Ret<ffi::AnyBuffer>());       // cache, updated in place
