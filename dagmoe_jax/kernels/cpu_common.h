// Shared by the CPU kernels (causal_attention.cc, grouped_matmul.cc, dag_module.cc): 16-float
// vectors, a vector exp and a parallel loop over XLA's intra-op thread pool. Included inside
// each kernel's anonymous namespace, after "xla/ffi/api/ffi.h" and
// `namespace ffi = xla::ffi;`. The build cache key (kernels/build.py) covers this file, so
// editing it rebuilds every kernel.

typedef float V __attribute__((vector_size(64)));
typedef float VUnaligned __attribute__((vector_size(64), aligned(4)));

inline V Load(const float* p) { return *reinterpret_cast<const VUnaligned*>(p); }
inline void Store(float* p, V x) { *reinterpret_cast<VUnaligned*>(p) = x; }
inline V Splat(float x) { return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

typedef int32_t VI __attribute__((vector_size(64)));

// exp(x), lane-wise, for x <= ~0 (Cephes expf: range reduction by ln 2 and
// a degree-6 polynomial, relative error about 1e-7; inputs below -87 give exp(-87)).
inline V ExpV(V x) {
  const V lo = Splat(-87.0f), magic = Splat(12582912.0f);  // 1.5 * 2^23: rounds to integers
  x = x < lo ? lo : x;
  const V t = x * 1.44269504088896341f + magic;
  const V n = t - magic;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const V z = r * r;
  const V y = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z +
              r + 1.0f;
  const VI bits = ((VI)t - (VI)magic + 127) << 23;  // 2^n
  return y * (V)bits;
}

// Runs f(0) ... f(n - 1) on the calling thread and up to num_threads - 1 pool threads. A pool
// task that starts after all items are taken returns without touching f.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  if (n <= 0) return;
  auto state = std::make_shared<State>();
  const F* body = &f;
  auto run = [state, n, body]() {
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      (*body)(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}
