// The DAG module's elementwise work for XLA:CPU, as XLA FFI handlers for the forward passes and
// their gradients: the pairwise messages (DAG-MoE eq. 9-10, summed over senders as eq. 11
// needs) and the LayerNorm of eq. 7.
//
// Messages. Layouts (row-major, float32). proj [T, K, 4 G] holds, for each token t and node
// i, the node's down-projection u_i times the four halves of the eq. 9 weights, in the order
// [e_i | n_i | e_j | n_j] (W_edge's receiver half, W_node's receiver half, W_edge's sender
// half, W_node's sender half), so that W [u_i; u_j] = W_a u_i + W_b u_j:
//
//   DagmoeDagMessages     proj [T, K, 4G]             -> msg [T, K, G]
//       msg_i = sum_{j in senders(i)} act(e_i + e_j) * (n_i + n_j)
//   DagmoeDagMessagesBwd  proj [T, K, 4G], dmsg [T, K, G] -> dproj [T, K, 4G]
//
// act is silu (attribute act = 0) or sigmoid (1); senders(i) is every node (edges = 0), the
// nodes ranked at or above i (j <= i, edges = 1) or i alone (edges = 2). The K x K pair tensor
// that XLA materialises (and stores for its backward pass) is never built: a token's nodes fit
// in L1, the forward pass keeps one [G] accumulator per node, and the backward pass recomputes
// each pair's gate from proj instead of saving it. Tokens are spread over XLA's intra-op
// thread pool in blocks, the calling thread taking part. G must be a multiple of 16.
//
// LayerNorm over the last axis of x [R, D] (any leading shape), D a multiple of 16:
//
//   DagmoeLayerNorm     x [R, D], scale [D], bias [D]  -> y [R, D], stats [R, 2]
//       y = (x - mean) * rstd * scale + bias, stats = (mean, rstd), rstd = 1 / sqrt(var + eps)
//   DagmoeLayerNormBwd  x, scale, stats, dy            -> dx [R, D], dparams [P, 2, D]
//       dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy * scale, xhat = (x - mean) rstd;
//       dparams[p] = (sum dy * xhat, sum dy) over the p-th block of kRows rows
//
// XLA:CPU runs the row reductions of this LayerNorm inside its YNNPACK fusions, where one
// iteration's forward and backward took 3x this kernel's time at the s model's shape. Each row
// is one pass to its statistics and one to its output; the backward pass recomputes xhat from
// the saved statistics, and the per-block parameter gradients are summed by the caller.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "cpu_common.h"  // V, Load, Store, Splat, ExpV, ParallelFor

constexpr int64_t kVec = 16;
constexpr int64_t kTokens = 32;  // tokens per work item

// sigmoid(a) lane-wise from exp(-|a|) <= 1, so the exponent never overflows.
inline V SigmoidV(V a) {
  const V e = ExpV(a < 0.0f ? a : -a);
  const V inv = 1.0f / (1.0f + e);
  return a < 0.0f ? e * inv : inv;
}

// Whether node i hears node j.
inline bool Hears(int64_t edges, int64_t i, int64_t j) {
  return edges == 0 || (edges == 1 ? j <= i : j == i);
}

struct Dims {
  int64_t t, k, g;
};

ffi::Error CheckDims(ffi::Buffer<ffi::F32>& proj, int64_t edges, int64_t act, Dims* dims) {
  const auto d = proj.dimensions();
  if (d.size() != 3 || d[2] % (4 * kVec) != 0)
    return ffi::Error::InvalidArgument(
        "dag messages: proj must be [T, K, 4 G] with G a multiple of 16");
  if (edges < 0 || edges > 2 || act < 0 || act > 1)
    return ffi::Error::InvalidArgument("dag messages: edges must be 0-2 and act 0-1");
  *dims = Dims{d[0], d[1], d[2] / 4};
  return ffi::Error::Success();
}

template <bool kSilu>
void ForwardToken(const float* p, float* msg, const Dims& s, int64_t edges) {
  const int64_t g = s.g, row = 4 * g;
  for (int64_t i = 0; i < s.k; ++i) {
    const float* pi = p + i * row;
    for (int64_t c = 0; c < g; c += kVec) {
      const V ei = Load(pi + c), ni = Load(pi + g + c);
      V acc = Splat(0.0f);
      for (int64_t j = 0; j < s.k; ++j) {
        if (!Hears(edges, i, j)) continue;
        const float* pj = p + j * row;
        const V a = ei + Load(pj + 2 * g + c), b = ni + Load(pj + 3 * g + c);
        const V sg = SigmoidV(a);
        acc += (kSilu ? a * sg : sg) * b;
      }
      Store(msg + i * g + c, acc);
    }
  }
}

template <bool kSilu>
void BackwardToken(const float* p, const float* dmsg, float* dp, const Dims& s,
                   int64_t edges) {
  const int64_t g = s.g, row = 4 * g;
  std::memset(dp, 0, sizeof(float) * s.k * row);
  for (int64_t i = 0; i < s.k; ++i) {
    const float* pi = p + i * row;
    float* di = dp + i * row;
    for (int64_t c = 0; c < g; c += kVec) {
      const V ei = Load(pi + c), ni = Load(pi + g + c), gi = Load(dmsg + i * g + c);
      V dei = Splat(0.0f), dni = Splat(0.0f);
      for (int64_t j = 0; j < s.k; ++j) {
        if (!Hears(edges, i, j)) continue;
        const float* pj = p + j * row;
        float* dj = dp + j * row;
        const V a = ei + Load(pj + 2 * g + c), b = ni + Load(pj + 3 * g + c);
        const V sg = SigmoidV(a);
        // silu: act = a s, act' = s (1 + a (1 - s)); sigmoid: act = s, act' = s (1 - s)
        const V one_minus = 1.0f - sg;
        const V act = kSilu ? a * sg : sg;
        const V dact = kSilu ? sg * (1.0f + a * one_minus) : sg * one_minus;
        const V da = gi * dact * b, db = gi * act;
        dei += da;
        dni += db;
        Store(dj + 2 * g + c, Load(dj + 2 * g + c) + da);
        Store(dj + 3 * g + c, Load(dj + 3 * g + c) + db);
      }
      Store(di + c, dei);
      Store(di + g + c, dni);
    }
  }
}

// Runs body(token) for every token, kTokens tokens per pool work item.
template <typename F>
void ForTokens(ffi::ThreadPool& pool, int64_t t, const F& body) {
  ParallelFor(pool, (t + kTokens - 1) / kTokens, [&](int64_t item) {
    const int64_t end = std::min(t, (item + 1) * kTokens);
    for (int64_t tok = item * kTokens; tok < end; ++tok) body(tok);
  });
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> proj,
                   ffi::Result<ffi::Buffer<ffi::F32>> msg, int64_t edges, int64_t act) {
  Dims s;
  if (ffi::Error e = CheckDims(proj, edges, act, &s); e.failure()) return e;
  const float* p = proj.typed_data();
  float* out = msg->typed_data();
  ForTokens(pool, s.t, [&](int64_t tok) {
    const float* pt = p + tok * s.k * 4 * s.g;
    float* ot = out + tok * s.k * s.g;
    if (act == 0) ForwardToken<true>(pt, ot, s, edges);
    else ForwardToken<false>(pt, ot, s, edges);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> proj,
                    ffi::Buffer<ffi::F32> dmsg, ffi::Result<ffi::Buffer<ffi::F32>> dproj,
                    int64_t edges, int64_t act) {
  Dims s;
  if (ffi::Error e = CheckDims(proj, edges, act, &s); e.failure()) return e;
  const float* p = proj.typed_data();
  const float* gm = dmsg.typed_data();
  float* out = dproj->typed_data();
  ForTokens(pool, s.t, [&](int64_t tok) {
    const int64_t off = tok * s.k * 4 * s.g;
    const float* gt = gm + tok * s.k * s.g;
    if (act == 0) BackwardToken<true>(p + off, gt, out + off, s, edges);
    else BackwardToken<false>(p + off, gt, out + off, s, edges);
  });
  return ffi::Error::Success();
}

// LayerNorm rows per work item (one dparams block): LAYER_NORM_ROWS in dag_module.py
constexpr int64_t kRows = 64;

inline float HSum(V x) {
  float s = 0.0f;
  for (int i = 0; i < kVec; ++i) s += x[i];
  return s;
}

// The last dimension of x (the normalised one) and the number of rows before it.
ffi::Error RowDims(ffi::Buffer<ffi::F32>& x, int64_t n_params, int64_t* rows, int64_t* d) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims[dims.size() - 1] % kVec != 0 || dims[dims.size() - 1] != n_params)
    return ffi::Error::InvalidArgument(
        "dag layer norm: x must be [..., D] with D a multiple of 16 and scale [D]");
  *d = dims[dims.size() - 1];
  *rows = x.element_count() / *d;
  return ffi::Error::Success();
}

ffi::Error LayerNormForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                            ffi::Result<ffi::Buffer<ffi::F32>> y,
                            ffi::Result<ffi::Buffer<ffi::F32>> stats, float eps) {
  int64_t rows, d;
  if (ffi::Error e = RowDims(x, scale.element_count(), &rows, &d); e.failure()) return e;
  const float *xp = x.typed_data(), *sp = scale.typed_data(), *bp = bias.typed_data();
  float *yp = y->typed_data(), *st = stats->typed_data();
  ParallelFor(pool, (rows + kRows - 1) / kRows, [&](int64_t item) {
    const int64_t end = std::min(rows, (item + 1) * kRows);
    for (int64_t r = item * kRows; r < end; ++r) {
      const float* xr = xp + r * d;
      float* yr = yp + r * d;
      V sum = Splat(0.0f);
      for (int64_t c = 0; c < d; c += kVec) sum += Load(xr + c);
      const float mean = HSum(sum) / d;
      V sq = Splat(0.0f);
      for (int64_t c = 0; c < d; c += kVec) {
        const V v = Load(xr + c) - mean;
        sq += v * v;
      }
      const float rstd = 1.0f / std::sqrt(HSum(sq) / d + eps);
      for (int64_t c = 0; c < d; c += kVec)
        Store(yr + c, (Load(xr + c) - mean) * rstd * Load(sp + c) + Load(bp + c));
      st[2 * r] = mean;
      st[2 * r + 1] = rstd;
    }
  });
  return ffi::Error::Success();
}

ffi::Error LayerNormBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> stats,
                             ffi::Buffer<ffi::F32> dy, ffi::Result<ffi::Buffer<ffi::F32>> dx,
                             ffi::Result<ffi::Buffer<ffi::F32>> dparams) {
  int64_t rows, d;
  if (ffi::Error e = RowDims(x, scale.element_count(), &rows, &d); e.failure()) return e;
  const float *xp = x.typed_data(), *sp = scale.typed_data(), *st = stats.typed_data();
  const float* gp = dy.typed_data();
  float *dxp = dx->typed_data(), *dpp = dparams->typed_data();
  ParallelFor(pool, (rows + kRows - 1) / kRows, [&](int64_t item) {
    float* dscale = dpp + item * 2 * d;
    float* dbias = dscale + d;
    std::memset(dscale, 0, sizeof(float) * 2 * d);
    const int64_t end = std::min(rows, (item + 1) * kRows);
    for (int64_t r = item * kRows; r < end; ++r) {
      const float *xr = xp + r * d, *gr = gp + r * d;
      float* out = dxp + r * d;
      const float mean = st[2 * r], rstd = st[2 * r + 1];
      V sum_g = Splat(0.0f), sum_gx = Splat(0.0f);
      for (int64_t c = 0; c < d; c += kVec) {
        const V xhat = (Load(xr + c) - mean) * rstd, g = Load(gr + c), gs = g * Load(sp + c);
        sum_g += gs;
        sum_gx += gs * xhat;
        Store(dscale + c, Load(dscale + c) + g * xhat);
        Store(dbias + c, Load(dbias + c) + g);
      }
      const float mean_g = HSum(sum_g) / d, mean_gx = HSum(sum_gx) / d;
      for (int64_t c = 0; c < d; c += kVec) {
        const V xhat = (Load(xr + c) - mean) * rstd, gs = Load(gr + c) * Load(sp + c);
        Store(out + c, rstd * (gs - mean_g - xhat * mean_gx));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeDagMessages, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("edges")
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeDagMessagesBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("edges")
                                  .Attr<int64_t>("act"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeLayerNorm, LayerNormForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DagmoeLayerNormBwd, LayerNormBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
