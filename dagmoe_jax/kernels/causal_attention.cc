// Fused causal grouped-query attention for XLA:CPU: forward and backward as XLA FFI handlers.
//
// Layouts (row-major, float32): q, out, dout, dq [B, S, H, D]; k, v, dk, dv [B, S, KV, D];
// lse [B, H, S] (the log-sum-exp of each query row's scaled scores, saved by the forward pass
// for the backward pass, as in FlashAttention). H is a multiple of KV (grouped-query
// attention: query head h reads key/value head h / (H / KV)).
//
// One work item is one (batch row, key/value head) pair. It copies its keys and values once
// into tiles of 16 keys ([S / 16, D, 16]) and contiguous rows, then walks the query rows: each
// row's visible scores [0, i] are computed 16 keys per vector, softmaxed and reduced against
// the values without an S x S matrix ever being written to memory. That is what makes this
// faster than XLA:CPU's blockwise attention, which at head_dim 16 is bound by the passes over
// its score blocks. The G query heads that share the KV head are taken together, up to four at
// a time (kHeads): every key and value vector a score or weighted-sum loop loads serves all of
// them, which at head_dim 16 made the forward pass 0.77x and forward + backward 0.74x of one
// head at a time (benchmarks/RESULTS.md). The backward pass recomputes each row's
// probabilities from the saved log-sum-exp and accumulates the key and value gradients of the
// G heads in one read-modify-write per tile. Work items are spread over XLA's intra-op thread
// pool; the calling thread takes part.
//
// Packed sequences: the *Segmented handlers take one more input, segment ids int32 [B, S], and
// let query i see key j only when j <= i and both have the same id. Each row then starts at the
// 16-key tile holding the first key of its segment (the keys before it are skipped, not just
// masked) and masks the other segments' lanes inside the tiles it visits. The same templates
// with kSeg false are the plain handlers, whose code is unchanged by this.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector of 16 floats: a zmm register with AVX-512, two ymm with AVX2 (GCC/Clang vector
// extensions, so the same source builds for whatever -march=native finds).
#include "cpu_common.h"  // V, Load, Store, Splat, ParallelFor

typedef int32_t VIUnaligned __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kChunk = 16;  // keys per vector

inline int64_t RoundUp(int64_t n) { return (n + kChunk - 1) / kChunk * kChunk; }
inline V Iota() { return V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// Horizontal sum and max by halving (a tree of 4 vector steps, not a chain of 15 scalar ones).
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

template <typename Op>
inline float Reduce(V x, const Op& op) {
  const V8 s8 = op(V8{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]},
                   V8{x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]});
  const V4 s4 = op(V4{s8[0], s8[1], s8[2], s8[3]}, V4{s8[4], s8[5], s8[6], s8[7]});
  return op(op(s4[0], s4[1]), op(s4[2], s4[3]));
}

inline float HSum(V x) {
  return Reduce(x, [](auto a, auto b) { return a + b; });
}

inline float HMax(V x) {
  return Reduce(x, [](auto a, auto b) { return a > b ? a : b; });
}


// One batch row's segment ids, for the segmented handlers: ids padded to SP entries (the pad
// lanes are past every row's n and masked anyway) and, for each query, the first key of its
// segment rounded down to a tile (where its row of scores starts).
struct Segments {
  std::vector<int32_t> ids;
  std::vector<int64_t> from;
};

inline Segments RowSegments(const int32_t* seg, int64_t s, int64_t sp) {
  Segments out{std::vector<int32_t>(sp, 0), std::vector<int64_t>(s)};
  std::unordered_map<int32_t, int64_t> first;
  for (int64_t j = 0; j < s; ++j) {
    out.ids[j] = seg[j];
    out.from[j] = first.emplace(seg[j], j).first->second / kChunk * kChunk;
  }
  return out;
}

// x in the lanes of the chunk starting at key j0 that are visible to a query row seeing keys
// [0, n) (with kSeg: and whose key is in segment `id`), `hidden` in the others.
template <bool kSeg>
inline V Mask(V x, int64_t j0, int64_t n, const int32_t* ids, int32_t id, float hidden) {
  if constexpr (!kSeg) {
    if (j0 + kChunk <= n) return x;  // a whole chunk below the diagonal: every lane visible
  }
  VI keep = (Iota() + static_cast<float>(j0)) < static_cast<float>(n);
  if constexpr (kSeg) keep &= *reinterpret_cast<const VIUnaligned*>(ids + j0) == id;
  return keep ? x : Splat(hidden);
}


struct Shape {
  int64_t b, s, h, kv, g, sp;
  float scale;
};

// Keys and values live in scratch as tiles [SP / 16, D, 16]: the tile of keys j0 .. j0 + 15
// starts at xt + j0 * D and holds their d-th components at offset d * 16, so every vector a
// loop needs is at a constant offset from one pointer. Tiled(j, d) is that element's index.
template <int D>
inline int64_t Tiled(int64_t j, int d) {
  return (j / kChunk) * (D * kChunk) + d * kChunk + j % kChunk;
}

// Copies key/value head `kvh` of batch row `b` from [B, S, KV, D] into tiles (keys >= S
// zeroed).
template <int D>
void GatherTiles(const float* x, const Shape& sh, int64_t b, int64_t kvh, float* xt) {
  for (int64_t j = 0; j < sh.s; ++j) {
    const float* row = x + ((b * sh.s + j) * sh.kv + kvh) * D;
    for (int d = 0; d < D; ++d) xt[Tiled<D>(j, d)] = row[d];
  }
  for (int64_t j = sh.s; j < sh.sp; ++j)
    for (int d = 0; d < D; ++d) xt[Tiled<D>(j, d)] = 0.0f;
}

// Copies key/value head `kvh` of batch row `b` into contiguous rows [SP, D] (a strided read in
// place would use only a few cache sets).
template <int D>
void GatherRows(const float* x, const Shape& sh, int64_t b, int64_t kvh, float* xr) {
  for (int64_t j = 0; j < sh.s; ++j)
    std::memcpy(xr + j * D, x + ((b * sh.s + j) * sh.kv + kvh) * D, D * sizeof(float));
}

template <int D>
void ScatterTiles(const float* xt, const Shape& sh, int64_t b, int64_t kvh, float* x) {
  for (int64_t j = 0; j < sh.s; ++j) {
    float* row = x + ((b * sh.s + j) * sh.kv + kvh) * D;
    for (int d = 0; d < D; ++d) row[d] = xt[Tiled<D>(j, d)];
  }
}

// out[d] = sum_j p[j] * x_j[d] for j in [0, np) (x tiled): the row's weighted sum of value (or
// key) vectors, one vector accumulator per d (16 d at a time) so the chains are independent.
template <int D>
inline void RowDots(const float* p, const float* xt, int64_t np, float* out) {
  constexpr int kBlock = D < 16 ? D : 16;
  for (int d0 = 0; d0 < D; d0 += kBlock) {
    V acc[kBlock];
#pragma GCC unroll 16
    for (int d = 0; d < kBlock; ++d) acc[d] = V{};
    for (int64_t j0 = 0; j0 < np; j0 += kChunk) {
      const V pc = Load(p + j0);
      const float* tile = xt + j0 * D + d0 * kChunk;
#pragma GCC unroll 16
      for (int d = 0; d < kBlock; ++d) acc[d] += pc * Load(tile + d * kChunk);
    }
#pragma GCC unroll 16
    for (int d = 0; d < kBlock; ++d) out[d0 + d] = HSum(acc[d]);
  }
}

// WeightedSumN reads contiguous rows when D is a multiple of 16 (no horizontal sums), tiles
// otherwise.
template <int D>
constexpr bool kSumsRows = D % kChunk == 0;

// y[0 : rows * D] = x[0 : rows * D] * c (16 lanes at a time when D allows).
template <int D>
inline void Scale(const float* x, int64_t rows, float c, float* y) {
  if constexpr (D % kChunk == 0) {
    const V cv = Splat(c);
    for (int64_t t = 0; t < rows * D; t += kChunk) Store(y + t, Load(x + t) * cv);
  } else {
    for (int64_t t = 0; t < rows * D; ++t) y[t] = x[t] * c;
  }
}

// sum_d x[d] * y[d].
template <int D>
inline float Dot(const float* x, const float* y) {
  if constexpr (D % kChunk == 0) {
    V acc{};
    for (int d = 0; d < D; d += kChunk) acc += Load(x + d) * Load(y + d);
    return HSum(acc);
  } else {
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += x[d] * y[d];
    return acc;
  }
}

// Query heads of one KV head taken together: kHeads<D> heads share every key (or value) vector
// a loop loads, which at head_dim 16 cuts the loads per FMA to half or less (taking one head
// at a time, the loops were bound by their loads, not their FMAs). Their accumulators fill at
// most 16 registers.
template <int D>
constexpr int kHeads = D / kChunk >= 16 ? 1 : D / kChunk >= 8 ? 2 : 4;

// Keeps x in a register at this point: GCC otherwise folds a vector's load into each FMA that
// uses it (RowScoresN: NH loads where one will do, and the loop was bound by its loads). Only
// where a V is one register (AVX-512); elsewhere the compiler decides as before.
inline void InRegister(V& x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#else
  (void)x;
#endif
}

// out[h * os + j] = sum_d w[h * D + d] * x_j[d] for the NH vectors w_h, j in [0, np) (np a
// multiple of kChunk; x tiled): NH rows of scores q_h . k_j (or dout_h . v_j), four tiles at a
// time so that the accumulator chains hide the FMA latency, each tile vector loaded once for
// all NH heads.
template <int D, int NH>
inline void RowScoresN(const float* w, const float* xt, int64_t np, float* out, int64_t os) {
  constexpr int64_t kTile = D * kChunk;
  constexpr int kT = 4;  // tiles per step: NH x 4 accumulators
  int64_t j0 = 0;
  for (; j0 + kT * kChunk <= np; j0 += kT * kChunk) {
    V acc[NH][kT] = {};
    const float* tile = xt + j0 * D;
#pragma GCC unroll 16
    for (int d = 0; d < D; ++d) {
      V x[kT];
#pragma GCC unroll 4
      for (int t = 0; t < kT; ++t) {
        x[t] = Load(tile + d * kChunk + t * kTile);
        InRegister(x[t]);
      }
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const V c = Splat(w[h * D + d]);
#pragma GCC unroll 4
        for (int t = 0; t < kT; ++t) acc[h][t] += c * x[t];
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
      for (int t = 0; t < kT; ++t) Store(out + h * os + j0 + t * kChunk, acc[h][t]);
  }
  for (; j0 < np; j0 += kChunk) {
    V acc[NH] = {};
#pragma GCC unroll 16
    for (int d = 0; d < D; ++d) {
      const V x = Load(xt + j0 * D + d * kChunk);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) acc[h] += Splat(w[h * D + d]) * x;
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) Store(out + h * os + j0, acc[h]);
  }
}

// out[h * D + d] = sum_{j < n} p[h * ps + j] * x_j[d] for NH heads, x_j = rows + j * D (D a
// multiple of 16): one broadcast FMA per head, key and vector of x_j, each x_j loaded once for
// all NH heads, keys unrolled so that at least 8 accumulator chains are independent, and no
// horizontal sums.
template <int D, int NH>
inline void RowDotsRowsN(const float* p, int64_t ps, const float* rows, int64_t n, float* out) {
  constexpr int kVecs = D / kChunk;
  constexpr int kUnroll = NH * kVecs >= 8 ? 1 : 8 / (NH * kVecs);
  V acc[kUnroll][NH][kVecs] = {};
  int64_t j = 0;
  for (; j + kUnroll <= n; j += kUnroll) {
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) {
      const float* x = rows + (j + u) * D;
      V xv[kVecs];
#pragma GCC unroll 16
      for (int c = 0; c < kVecs; ++c) xv[c] = Load(x + c * kChunk);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const V ph = Splat(p[h * ps + j + u]);
#pragma GCC unroll 16
        for (int c = 0; c < kVecs; ++c) acc[u][h][c] += ph * xv[c];
      }
    }
  }
  for (; j < n; ++j) {
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const V ph = Splat(p[h * ps + j]);
#pragma GCC unroll 16
      for (int c = 0; c < kVecs; ++c) acc[0][h][c] += ph * Load(rows + j * D + c * kChunk);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) {
      V s = acc[0][h][c];
#pragma GCC unroll 8
      for (int u = 1; u < kUnroll; ++u) s += acc[u][h][c];
      Store(out + h * D + c * kChunk, s);
    }
}

// out_h = sum_j p_h[j] * x_j over the keys [0, n) a row sees, for NH heads (p_h = p + h * ps,
// out_h = out + h * D), x in WeightedSumN's layout (kSumsRows).
template <int D, int NH>
inline void WeightedSumN(const float* p, int64_t ps, const float* x, int64_t n, float* out) {
  if constexpr (kSumsRows<D>) {
    RowDotsRowsN<D, NH>(p, ps, x, n, out);
  } else {
    for (int h = 0; h < NH; ++h) RowDots<D>(p + h * ps, x, RoundUp(n), out + h * D);
  }
}

// Runs body(std::integral_constant<int, nh>(), g0) over the heads [0, g_n) in runs of
// kHeads<D> (the last run shorter, as single heads), so the multi-head loops get compile-time
// head counts.
template <int D, typename F>
inline void ForHeadRuns(int64_t g_n, const F& body) {
  int64_t g0 = 0;
  for (; g0 + kHeads<D> <= g_n; g0 += kHeads<D>) body(std::integral_constant<int, kHeads<D>>(), g0);
  for (; g0 < g_n; ++g0) body(std::integral_constant<int, 1>(), g0);
}

// A query row's G heads are G * D contiguous floats, but consecutive rows are H * D floats
// apart (2 KB at the s shape) with thousands of cycles of key loops between them, and the
// hardware prefetcher did not follow: the first read of each row missed the cache, about a
// fifth of the forward and a quarter of the backward pass's time (perf annotate). Each row
// now asks for the rows kAhead query rows on (kWrite: rows it will write).
constexpr int64_t kAhead = 4;

template <int D, int kWrite = 0>
inline void PrefetchRow(const float* x, int64_t g_n) {
  for (int64_t t = 0; t < g_n * D; t += kChunk) __builtin_prefetch(x + t, kWrite);
}

template <int D, bool kSeg>
void ForwardItem(const float* q, const float* k, const float* v, const int32_t* seg,
                 float* out, float* lse, const Shape& sh, int64_t item) {
  const int64_t b = item / sh.kv, kvh = item % sh.kv, sp = sh.sp;
  Segments segs;
  if constexpr (kSeg) segs = RowSegments(seg + b * sh.s, sh.s, sp);
  const int64_t g_n = sh.g;
  std::vector<float> scratch(2 * D * sp + g_n * sp + 2 * g_n * D);
  float* kt = scratch.data();
  float* vs = kt + D * sp;  // the values in WeightedSumN's layout
  float* p = vs + D * sp;   // [G, SP]: the scores, then probabilities, of the row's G heads
  float* qs = p + g_n * sp;  // [G, D]: their scaled queries
  float* o = qs + g_n * D;   // [G, D]: their unnormalised outputs
  GatherTiles<D>(k, sh, b, kvh, kt);
  if constexpr (kSumsRows<D>) {
    GatherRows<D>(v, sh, b, kvh, vs);
  } else {
    GatherTiles<D>(v, sh, b, kvh, vs);
  }
  for (int64_t i = 0; i < sh.s; ++i) {
    const int64_t n = i + 1, np = RoundUp(n);
    int64_t lo = 0;  // the first tile of keys this row may see
    int32_t id = 0;
    if constexpr (kSeg) lo = segs.from[i], id = segs.ids[i];
    const int32_t* ids = kSeg ? segs.ids.data() : nullptr;
    const int64_t row0 = (b * sh.s + i) * sh.h + kvh * g_n;  // the row of head g = 0
    if (i + kAhead < sh.s) {
      const int64_t ahead = row0 + kAhead * sh.h;
      PrefetchRow<D>(q + ahead * D, g_n);
      PrefetchRow<D, 1>(out + ahead * D, g_n);
    }
    Scale<D>(q + row0 * D, g_n, sh.scale, qs);
    ForHeadRuns<D>(g_n, [&](auto nh, int64_t g0) {
      constexpr int NH = decltype(nh)::value;
      RowScoresN<D, NH>(qs + g0 * D, kt + lo * D, np - lo, p + g0 * sp + lo, sp);
      float m[NH], sum[NH];
      for (int h = 0; h < NH; ++h) {
        float* ph = p + (g0 + h) * sp;
        V mv = Splat(-INFINITY);
        for (int64_t j0 = lo; j0 < np; j0 += kChunk) {
          const V x = Mask<kSeg>(Load(ph + j0), j0, n, ids, id, -INFINITY);
          mv = mv > x ? mv : x;
        }
        m[h] = HMax(mv);
        const V mh = Splat(m[h]);
        V sv{};
        for (int64_t j0 = lo; j0 < np; j0 += kChunk) {
          const V e = Mask<kSeg>(ExpV(Load(ph + j0) - mh), j0, n, ids, id, 0.0f);
          Store(ph + j0, e);
          sv += e;
        }
        sum[h] = HSum(sv);
      }
      WeightedSumN<D, NH>(p + g0 * sp + lo, sp, vs + lo * D, n - lo, o + g0 * D);
      for (int h = 0; h < NH; ++h) {
        const int64_t g = g0 + h;
        Scale<D>(o + g * D, 1, 1.0f / sum[h], out + (row0 + g) * D);
        lse[(b * sh.h + kvh * g_n + g) * sh.s + i] = m[h] + std::log(sum[h]);
      }
    });
  }
}

// tile[d, :] += sum_g w[g * D + d] * x[g * stride + :] for one tile of 16 keys: D / 16 blocks
// of 16 independent accumulator vectors, so the FMA chains do not wait on each other.
template <int D>
inline void AccumulateTile(float* tile, const float* x, const float* w, int64_t stride,
                           int64_t g_n) {
  constexpr int kBlock = D < 16 ? D : 16;
  for (int d0 = 0; d0 < D; d0 += kBlock) {
    V acc[kBlock];
#pragma GCC unroll 16
    for (int d = 0; d < kBlock; ++d) acc[d] = Load(tile + (d0 + d) * kChunk);
    for (int64_t g = 0; g < g_n; ++g) {
      const V xg = Load(x + g * stride);
      const float* wg = w + g * D + d0;
#pragma GCC unroll 16
      for (int d = 0; d < kBlock; ++d) acc[d] += Splat(wg[d]) * xg;
    }
#pragma GCC unroll 16
    for (int d = 0; d < kBlock; ++d) Store(tile + (d0 + d) * kChunk, acc[d]);
  }
}

template <int D, bool kSeg>
void BackwardItem(const float* q, const float* k, const float* v, const int32_t* seg,
                  const float* out, const float* lse, const float* dout, float* dq, float* dk,
                  float* dv, const Shape& sh, int64_t item) {
  const int64_t b = item / sh.kv, kvh = item % sh.kv, sp = sh.sp, g_n = sh.g;
  Segments segs;
  if constexpr (kSeg) segs = RowSegments(seg + b * sh.s, sh.s, sp);
  // Regions are kChunk floats apart beyond their size, so that the accumulators of one tile
  // are not a multiple of 4 KiB apart (x86 falsely orders loads after such stores).
  const int64_t region = D * sp + kChunk;
  std::vector<float> scratch(5 * region + 3 * (g_n * sp + kChunk) + 3 * g_n * D);
  float* kt = scratch.data();
  float* vt = kt + region;
  float* dkt = vt + region;  // tiles accumulating scale * sum_i ds_ij q_i
  float* dvt = dkt + region;  // tiles accumulating sum_i p_ij dout_i
  float* kr = dvt + region;   // [SP, D]: the keys as rows, when WeightedSumN reads rows
  float* p = kr + region;     // [G, SP]: probabilities of the G query heads of this row
  float* ds = p + g_n * sp + kChunk;   // [G, SP]: their score gradients
  float* dp = ds + g_n * sp + kChunk;  // [G, SP]: their dout . v_j
  float* qs = dp + g_n * sp + kChunk;  // [G, D]: scaled queries
  float* dd = qs + g_n * D;   // [G, D]: output gradients
  float* dqs = dd + g_n * D;  // [G, D]: query gradients before the scale
  GatherTiles<D>(k, sh, b, kvh, kt);
  GatherTiles<D>(v, sh, b, kvh, vt);
  const float* ks = kt;  // the keys in WeightedSumN's layout
  if constexpr (kSumsRows<D>) {
    GatherRows<D>(k, sh, b, kvh, kr);
    ks = kr;
  }
  for (int64_t i = 0; i < sh.s; ++i) {
    const int64_t n = i + 1, np = RoundUp(n);
    int64_t lo = 0;  // the first tile of keys this row may see
    int32_t id = 0;
    if constexpr (kSeg) lo = segs.from[i], id = segs.ids[i];
    const int32_t* ids = kSeg ? segs.ids.data() : nullptr;
    const int64_t row0 = (b * sh.s + i) * sh.h + kvh * g_n;  // the row of head g = 0
    if (i + kAhead < sh.s) {
      const int64_t ahead = row0 + kAhead * sh.h;
      PrefetchRow<D>(q + ahead * D, g_n);
      PrefetchRow<D>(dout + ahead * D, g_n);
      PrefetchRow<D>(out + ahead * D, g_n);
      PrefetchRow<D, 1>(dq + ahead * D, g_n);
    }
    Scale<D>(q + row0 * D, g_n, sh.scale, qs);
    std::memcpy(dd, dout + row0 * D, g_n * D * sizeof(float));
    ForHeadRuns<D>(g_n, [&](auto nh, int64_t g0) {
      constexpr int NH = decltype(nh)::value;
      RowScoresN<D, NH>(qs + g0 * D, kt + lo * D, np - lo, p + g0 * sp + lo, sp);
      RowScoresN<D, NH>(dd + g0 * D, vt + lo * D, np - lo, dp + g0 * sp + lo, sp);
      for (int h = 0; h < NH; ++h) {
        const int64_t g = g0 + h;
        // delta = sum_d dout_i[d] out_i[d] = sum_j p_ij (dout_i . v_j)
        const V delta = Splat(Dot<D>(dd + g * D, out + (row0 + g) * D));
        const V l = Splat(lse[(b * sh.h + kvh * g_n + g) * sh.s + i]);
        float* pg = p + g * sp;
        float* dsg = ds + g * sp;
        const float* dpg = dp + g * sp;
        for (int64_t j0 = lo; j0 < np; j0 += kChunk) {
          const V pj = Mask<kSeg>(ExpV(Load(pg + j0) - l), j0, n, ids, id, 0.0f);
          Store(pg + j0, pj);
          Store(dsg + j0, pj * (Load(dpg + j0) - delta));
        }
      }
      WeightedSumN<D, NH>(ds + g0 * sp + lo, sp, ks + lo * D, n - lo, dqs + g0 * D);
    });
    Scale<D>(dqs, g_n, sh.scale, dq + row0 * D);
    // dk_j += sum_g ds_gj q_g and dv_j += sum_g p_gj dout_g: each accumulator tile is read and
    // written once per row for all G heads.
    for (int64_t j0 = lo; j0 < np; j0 += kChunk) {
      AccumulateTile<D>(dkt + j0 * D, ds + j0, qs, sp, g_n);
      AccumulateTile<D>(dvt + j0 * D, p + j0, dd, sp, g_n);
    }
  }
  ScatterTiles<D>(dkt, sh, b, kvh, dk);
  ScatterTiles<D>(dvt, sh, b, kvh, dv);
}

ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                       ffi::Buffer<ffi::F32>& v, Shape* sh, int64_t* d) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("causal attention: q, k, v must be [B, S, heads, D]");
  for (int a = 0; a < 4; ++a)
    if (kd[a] != vd[a] || (a != 2 && kd[a] != qd[a]))
      return ffi::Error::InvalidArgument("causal attention: q, k, v shapes disagree");
  if (kd[2] <= 0 || qd[2] % kd[2] != 0)
    return ffi::Error::InvalidArgument("causal attention: heads must be a multiple of kv heads");
  sh->b = qd[0];
  sh->s = qd[1];
  sh->h = qd[2];
  sh->kv = kd[2];
  sh->g = qd[2] / kd[2];
  sh->sp = RoundUp(qd[1]);
  *d = qd[3];
  sh->scale = 1.0f / std::sqrt(static_cast<float>(qd[3]));
  return ffi::Error::Success();
}

// Runs body(std::integral_constant<int, D>()) with D = d, for the supported head dims.
template <typename F>
ffi::Error WithHeadDim(int64_t d, const F& body) {
  switch (d) {
    case 8: body(std::integral_constant<int, 8>()); break;
    case 16: body(std::integral_constant<int, 16>()); break;
    case 32: body(std::integral_constant<int, 32>()); break;
    case 64: body(std::integral_constant<int, 64>()); break;
    case 128: body(std::integral_constant<int, 128>()); break;
    case 256: body(std::integral_constant<int, 256>()); break;
    default:
      return ffi::Error::InvalidArgument("causal attention: head_dim " + std::to_string(d) +
                                         " is not one of 8, 16, 32, 64, 128, 256");
  }
  return ffi::Error::Success();
}

// Checks the shapes, then runs item(std::integral_constant<int, D>(), shape, index) for every
// (batch row, KV head) on the thread pool.
template <typename Item>
ffi::Error ForEachItem(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                       ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, const Item& item) {
  Shape sh;
  int64_t d;
  if (ffi::Error e = CheckShapes(q, k, v, &sh, &d); e.failure()) return e;
  return WithHeadDim(d, [&](auto dim) {
    ParallelFor(pool, sh.b * sh.kv, [&](int64_t index) { item(dim, sh, index); });
  });
}

template <bool kSeg>
ffi::Error ForwardImpl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                       ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, const int32_t* seg,
                       ffi::ResultBuffer<ffi::F32>& out, ffi::ResultBuffer<ffi::F32>& lse) {
  return ForEachItem(pool, q, k, v, [&](auto dim, const Shape& sh, int64_t index) {
    ForwardItem<decltype(dim)::value, kSeg>(q.typed_data(), k.typed_data(), v.typed_data(),
                                            seg, out->typed_data(), lse->typed_data(), sh,
                                            index);
  });
}

template <bool kSeg>
ffi::Error BackwardImpl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                        ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, const int32_t* seg,
                        ffi::Buffer<ffi::F32>& out, ffi::Buffer<ffi::F32>& lse,
                        ffi::Buffer<ffi::F32>& dout, ffi::ResultBuffer<ffi::F32>& dq,
                        ffi::ResultBuffer<ffi::F32>& dk, ffi::ResultBuffer<ffi::F32>& dv) {
  return ForEachItem(pool, q, k, v, [&](auto dim, const Shape& sh, int64_t index) {
    BackwardItem<decltype(dim)::value, kSeg>(q.typed_data(), k.typed_data(), v.typed_data(),
                                             seg, out.typed_data(), lse.typed_data(),
                                             dout.typed_data(), dq->typed_data(),
                                             dk->typed_data(), dv->typed_data(), sh, index);
  });
}

// Segment ids must be [B, S] for q [B, S, H, D].
ffi::Error CheckSegments(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::S32>& seg) {
  const auto qd = q.dimensions(), sd = seg.dimensions();
  if (qd.size() != 4 || sd.size() != 2 || sd[0] != qd[0] || sd[1] != qd[1])
    return ffi::Error::InvalidArgument("causal attention: segment ids must be [B, S]");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  return ForwardImpl<false>(pool, q, k, v, nullptr, out, lse);
}

ffi::Error ForwardSegmented(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse) {
  if (ffi::Error e = CheckSegments(q, seg); e.failure()) return e;
  return ForwardImpl<true>(pool, q, k, v, seg.typed_data(), out, lse);
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  return BackwardImpl<false>(pool, q, k, v, nullptr, out, lse, dout, dq, dk, dv);
}

ffi::Error BackwardSegmented(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> out,
                             ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                             ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                             ffi::ResultBuffer<ffi::F32> dv) {
  if (ffi::Error e = CheckSegments(q, seg); e.failure()) return e;
  return BackwardImpl<true>(pool, q, k, v, seg.typed_data(), out, lse, dout, dq, dk, dv);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeCausalAttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeCausalAttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeCausalAttentionSegmentedFwd, ForwardSegmented,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeCausalAttentionSegmentedBwd, BackwardSegmented,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
