// Grouped matmul for XLA:CPU (dropless MoE dispatch): one GEMM per group of rows, as XLA FFI
// handlers for the forward pass and both gradients.
//
// Layouts (row-major, float32): the M rows of lhs are sorted by group, group g owning the
// sizes[g] rows after those of groups 0 .. g - 1 (int32 sizes [G], non-negative, summing to at
// most M); rows past sum(sizes) belong to no group.
//
//   DagmoeGmm      lhs [M, K], rhs [G, K, N]  -> out [M, N]   out_g = lhs_g @ rhs[g]
//   DagmoeGmmT     dy  [M, N], rhs [G, K, N]  -> out [M, K]   out_g = dy_g @ rhs[g]^T
//   DagmoeTgmm     lhs [M, K], dy  [M, N]     -> out [G, K, N] out[g] = lhs_g^T @ dy_g
//   DagmoeWgrad    x   [T, K], dy  [T, N]     -> out [K, N]    out = x^T @ dy
//
// Rows that belong to no group are zero in the outputs of the first two; an empty group's
// out[g] is zero in the third. Every product is the same register-blocked kernel: a tile of
// kMr output rows x 32 columns (two 16-float vectors per row) accumulated over the contracted
// dimension from a packed, zero-padded [kdim, 32] panel of the right operand, with the left
// operand read through (row, contracted) strides, so the transposed products need no
// transposed copy of the large operand. A work item is one (group, 32-column panel): it packs
// its panel once and sweeps the group's row tiles; items are spread over XLA's intra-op
// thread pool, the calling thread taking part. The weight gradient reads its left operand
// x_g^T down the columns of x_g, a new cache line each step of the contracted dimension, which
// the hardware prefetcher does not fetch early enough: each step asks for the line kPrefetch
// steps ahead (at the MoE-s shape that took the call from 29.0 to 22.3 ms, the forward's speed).
//
// DagmoeWgrad is a dense layer's weight gradient, a product contracted over thousands of rows
// into a small [K, N] (XLA:CPU runs it at 40-70% of its matmul rate). The rows are split into
// one contiguous range per thread, each summed into its own copy of the output, and each range
// is swept in blocks of kChunk rows, small enough that the block of x and dy stays in L2 while
// every output tile adds the block's contribution to itself. DagmoeTgmm sweeps each group the
// same way when there are at least 4 groups a thread (one work item per group).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "cpu_common.h"  // V, Load, Store, Splat, ParallelFor

constexpr int64_t kNr = 32;  // output columns per tile: two vectors
constexpr int kMr = 8;       // output rows per tile (8 x 2 accumulators; 12 was no faster)
constexpr int64_t kPrefetch = 32;  // steps of the contracted dimension to prefetch A ahead
constexpr int64_t kChunk = 256;    // DagmoeWgrad: rows of the contraction per cache block



// A strided matrix view: element (i, j) at p[i * si + j * sj].
struct View {
  const float* p;
  int64_t si, sj;
};

// C[0:MR, 0:ncols] = A[0:MR, 0:kdim] @ panel[0:kdim, 0:32] (panel packed [kdim, 32], columns
// past ncols zero); C has row stride ldc. kAdd: C += the product instead.
template <int MR, bool kAdd = false>
void Tile(View a, const float* panel, int64_t kdim, float* c, int64_t ldc, int64_t ncols) {
  V acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    if (kAdd && ncols == kNr) {
      acc[r][0] = Load(c + r * ldc);
      acc[r][1] = Load(c + r * ldc + 16);
    } else {
      acc[r][0] = acc[r][1] = Splat(0.0f);
    }
  }
  for (int64_t p = 0; p < kdim; ++p) {
    const V b0 = Load(panel + p * kNr), b1 = Load(panel + p * kNr + 16);
    const float* ap = a.p + p * a.sj;
    // The weight gradient reads A down its columns, a new cache line every step: fetch the
    // one kPrefetch steps ahead (past the end it only names an address, which is harmless).
    __builtin_prefetch(ap + kPrefetch * a.sj);
    for (int r = 0; r < MR; ++r) {
      const V x = Splat(ap[r * a.si]);
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    if (ncols == kNr) {
      Store(cr, acc[r][0]);
      Store(cr + 16, acc[r][1]);
    } else {
      for (int64_t j = 0; j < ncols; ++j)
        cr[j] = (kAdd ? cr[j] : 0.0f) + (j < 16 ? acc[r][0][j] : acc[r][1][j - 16]);
    }
  }
}

// The last rem < kMr rows of Rows: Tile<rem>, found by counting MR down from kMr - 1.
template <int MR, bool kAdd = false>
void Tail(int64_t rem, View a, const float* panel, int64_t kdim, float* c, int64_t ldc,
          int64_t ncols) {
  if constexpr (MR > 0) {
    if (rem == MR) return Tile<MR, kAdd>(a, panel, kdim, c, ldc, ncols);
    Tail<MR - 1, kAdd>(rem, a, panel, kdim, c, ldc, ncols);
  }
}

// C[0:rows, 0:ncols] = A[0:rows, 0:kdim] @ panel (kAdd: +=), kMr rows at a time.
template <bool kAdd = false>
void Rows(View a, int64_t rows, const float* panel, int64_t kdim, float* c, int64_t ldc,
          int64_t ncols) {
  int64_t r = 0;
  for (; r + kMr <= rows; r += kMr)
    Tile<kMr, kAdd>({a.p + r * a.si, a.si, a.sj}, panel, kdim, c + r * ldc, ldc, ncols);
  Tail<kMr - 1, kAdd>(rows - r, {a.p + r * a.si, a.si, a.sj}, panel, kdim, c + r * ldc, ldc,
                      ncols);
}

// Packs B[0:kdim, j0:j0 + ncols] into panel [kdim, 32], zero-padding columns past ncols.
// A B stored transposed (contiguous along kdim) is read 16 floats of a column at a time, so
// each cache line it touches is used whole (reading it row by row would touch 32 lines a
// row apart for every panel row, which thrash in L1 at power-of-two strides).
void Pack(View b, int64_t kdim, int64_t j0, int64_t ncols, float* panel) {
  if (b.si == 1 && b.sj != 1) {
    int64_t p0 = 0;
    for (; p0 + 16 <= kdim; p0 += 16) {
      for (int64_t j = 0; j < ncols; ++j) {
        const V col = Load(b.p + (j0 + j) * b.sj + p0);
        for (int t = 0; t < 16; ++t) panel[(p0 + t) * kNr + j] = col[t];
      }
      for (int64_t j = ncols; j < kNr; ++j)
        for (int t = 0; t < 16; ++t) panel[(p0 + t) * kNr + j] = 0.0f;
    }
    b = {b.p + p0, b.si, b.sj};
    kdim -= p0;
    panel += p0 * kNr;
  }
  for (int64_t p = 0; p < kdim; ++p) {
    float* dst = panel + p * kNr;
    const float* src = b.p + p * b.si + j0 * b.sj;
    if (b.sj == 1 && ncols == kNr) {
      std::memcpy(dst, src, kNr * sizeof(float));
    } else {
      for (int64_t j = 0; j < ncols; ++j) dst[j] = src[j * b.sj];
      for (int64_t j = ncols; j < kNr; ++j) dst[j] = 0.0f;
    }
  }
}

// One group's product for every group: out_g [rows_g, ncols] = A_g [rows_g, kdim_g] @ B_g
// [kdim_g, ncols], with (A_g, rows_g, kdim_g, B_g, out_g) from geometry(g, ...).
template <typename Geometry>
void Grouped(ffi::ThreadPool& pool, int64_t groups, int64_t ncols, const Geometry& geometry) {
  const int64_t panels = (ncols + kNr - 1) / kNr;
  ParallelFor(pool, groups * panels, [&](int64_t item) {
    const int64_t g = item / panels, j0 = (item % panels) * kNr;
    View a{}, b{};
    int64_t rows = 0, kdim = 0, ldc = 0;
    float* c = nullptr;
    geometry(g, &a, &rows, &kdim, &b, &c, &ldc);
    if (rows == 0) return;
    thread_local std::vector<float> panel;
    panel.resize(std::max<int64_t>(kdim, 1) * kNr);
    Pack(b, kdim, j0, std::min(kNr, ncols - j0), panel.data());
    Rows(a, rows, panel.data(), kdim, c + j0, ldc, std::min(kNr, ncols - j0));
  });
}

// Checks sizes (non-negative, total at most m) and writes each group's first row to start.
ffi::Error Offsets(ffi::Buffer<ffi::S32>& sizes, int64_t groups, int64_t m,
                   std::vector<int64_t>* start) {
  if (sizes.dimensions().size() != 1 || sizes.dimensions()[0] != groups)
    return ffi::Error::InvalidArgument("grouped matmul: group sizes must be [G]");
  start->assign(groups + 1, 0);
  const int32_t* s = sizes.typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    if (s[g] < 0) return ffi::Error::InvalidArgument("grouped matmul: a group size is negative");
    (*start)[g + 1] = (*start)[g] + s[g];
  }
  if ((*start)[groups] > m)
    return ffi::Error::InvalidArgument("grouped matmul: group sizes sum to more than the rows");
  return ffi::Error::Success();
}

ffi::Error Gmm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs, ffi::Buffer<ffi::F32> rhs,
               ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || ld[1] != rd[1])
    return ffi::Error::InvalidArgument("grouped matmul: expected lhs [M, K], rhs [G, K, N]");
  const int64_t m = ld[0], k = ld[1], g_n = rd[0], n = rd[2];
  std::vector<int64_t> start;
  if (ffi::Error e = Offsets(sizes, g_n, m, &start); e.failure()) return e;
  const float *x = lhs.typed_data(), *w = rhs.typed_data();
  float* y = out->typed_data();
  std::memset(y + start[g_n] * n, 0, (m - start[g_n]) * n * sizeof(float));
  Grouped(pool, g_n, n, [&](int64_t g, View* a, int64_t* rows, int64_t* kdim, View* b,
                            float** c, int64_t* ldc) {
    *a = {x + start[g] * k, k, 1};
    *rows = start[g + 1] - start[g];
    *kdim = k;
    *b = {w + g * k * n, n, 1};
    *c = y + start[g] * n;
    *ldc = n;
  });
  return ffi::Error::Success();
}

ffi::Error GmmT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> rhs,
                ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto dd = dy.dimensions(), rd = rhs.dimensions();
  if (dd.size() != 2 || rd.size() != 3 || dd[1] != rd[2])
    return ffi::Error::InvalidArgument("grouped matmul: expected dy [M, N], rhs [G, K, N]");
  const int64_t m = dd[0], n = dd[1], g_n = rd[0], k = rd[1];
  std::vector<int64_t> start;
  if (ffi::Error e = Offsets(sizes, g_n, m, &start); e.failure()) return e;
  const float *d = dy.typed_data(), *w = rhs.typed_data();
  float* dx = out->typed_data();
  std::memset(dx + start[g_n] * k, 0, (m - start[g_n]) * k * sizeof(float));
  Grouped(pool, g_n, k, [&](int64_t g, View* a, int64_t* rows, int64_t* kdim, View* b,
                            float** c, int64_t* ldc) {
    *a = {d + start[g] * n, n, 1};
    *rows = start[g + 1] - start[g];
    *kdim = n;
    *b = {w + g * k * n, 1, n};  // rhs[g]^T: element (p, j) = rhs[g][j, p]
    *c = dx + start[g] * k;
    *ldc = k;
  });
  return ffi::Error::Success();
}

// out [k, n] += x[t0:t1]^T @ dy[t0:t1] for x [., k], dy [., n], kChunk rows at a time.
void WgradRange(const float* x, const float* dy, int64_t t0, int64_t t1, int64_t k, int64_t n,
                float* out) {
  thread_local std::vector<float> panel;
  panel.resize(kChunk * kNr);
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t rows = std::min(kChunk, t1 - c0);
    for (int64_t j0 = 0; j0 < n; j0 += kNr) {
      const int64_t ncols = std::min(kNr, n - j0);
      Pack({dy + c0 * n, n, 1}, rows, j0, ncols, panel.data());
      Rows<true>({x + c0 * k, 1, k}, k, panel.data(), rows, out + j0, n, ncols);
    }
  }
}

ffi::Error Tgmm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs, ffi::Buffer<ffi::F32> dy,
                ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto ld = lhs.dimensions(), dd = dy.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || dd.size() != 2 || od.size() != 3 || ld[0] != dd[0] ||
      od[1] != ld[1] || od[2] != dd[1])
    return ffi::Error::InvalidArgument(
        "grouped matmul: expected lhs [M, K], dy [M, N], out [G, K, N]");
  const int64_t m = ld[0], k = ld[1], n = dd[1], g_n = od[0];
  std::vector<int64_t> start;
  if (ffi::Error e = Offsets(sizes, g_n, m, &start); e.failure()) return e;
  const float *x = lhs.typed_data(), *d = dy.typed_data();
  float* dw = out->typed_data();
  // Many groups (at least 4 a thread): one work item per group, its rows swept in blocks that
  // stay in L2 (WgradRange; at the MoE-s shape 82-84% of the matmul rate, against 75-77% for the
  // panels below). Few groups: one item per (group, 32-column panel), so every thread has work.
  if (g_n >= 4 * std::max<int64_t>(1, pool.num_threads())) {
    ParallelFor(pool, g_n, [&](int64_t g) {
      std::memset(dw + g * k * n, 0, k * n * sizeof(float));
      WgradRange(x, d, start[g], start[g + 1], k, n, dw + g * k * n);
    });
    return ffi::Error::Success();
  }
  for (int64_t g = 0; g < g_n; ++g)  // empty groups get no work item that writes them
    if (start[g + 1] == start[g]) std::memset(dw + g * k * n, 0, k * n * sizeof(float));
  Grouped(pool, g_n, n, [&](int64_t g, View* a, int64_t* rows, int64_t* kdim, View* b,
                            float** c, int64_t* ldc) {
    const int64_t size = start[g + 1] - start[g];
    *a = {x + start[g] * k, 1, k};  // lhs_g^T: element (p, i) = lhs_g[i, p]
    *rows = size == 0 ? 0 : k;
    *kdim = size;
    *b = {d + start[g] * n, n, 1};
    *c = dw + g * k * n;
    *ldc = n;
  });
  return ffi::Error::Success();
}

ffi::Error Wgrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                 ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), dd = dy.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || dd.size() != 2 || od.size() != 2 || xd[0] != dd[0] ||
      od[0] != xd[1] || od[1] != dd[1])
    return ffi::Error::InvalidArgument("weight gradient: expected x [T, K], dy [T, N], out [K, N]");
  const int64_t t = xd[0], k = xd[1], n = dd[1];
  const float *xp = x.typed_data(), *dp = dy.typed_data();
  float* o = out->typed_data();
  // One contiguous range of whole chunks per thread; range p > 0 sums into a copy of its own.
  const int64_t chunks = (t + kChunk - 1) / kChunk;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), chunks));
  std::vector<float> copies((parts - 1) * k * n);
  ParallelFor(pool, parts, [&](int64_t p) {
    float* dst = p == 0 ? o : copies.data() + (p - 1) * k * n;
    std::memset(dst, 0, k * n * sizeof(float));
    const int64_t t0 = std::min(t, chunks * p / parts * kChunk);
    const int64_t t1 = std::min(t, chunks * (p + 1) / parts * kChunk);
    WgradRange(xp, dp, t0, t1, k, n, dst);
  });
  for (int64_t p = 1; p < parts; ++p) {
    const float* src = copies.data() + (p - 1) * k * n;
    for (int64_t i = 0; i < k * n; ++i) o[i] += src[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeWgrad, Wgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeGmm, Gmm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeGmmT, GmmT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeTgmm, Tgmm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
