// CPU kernel of the packed float32 linear (contract in csrc/include/verl/packed_linear.h).
//
// A decode step multiplies a few rows by every weight matrix of the model. The weight is packed once per
// weight sync into panels of 16 output rows with k outermost ([P, K, 16]), so a panel is one contiguous
// stream, and a block of MR activation rows x 16 outputs lives in 2 x MR registers: per k, two weight vectors,
// MR broadcast activations and 2 x MR FMAs (MR = 6: 12 accumulators, the largest block that fits AVX2's 16
// registers with the two weight vectors and one broadcast). The panels are the parallel (outer) loop; while a
// panel's first row block runs, the next panel is asked for (one prefetch per k), so the weight stream from
// memory overlaps the arithmetic. The sums run over k in order for every output, whatever the number of rows:
// a row's result does not depend on the rows beside it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "verl/cpu_math.h"
#include "verl/packed_linear.h"

namespace verl {
namespace {

struct Problem {
  const float* x;
  const float* w;  // [P, K, 16]
  const float* bias;
  float* out;
  int64_t M, N, K;
};

// out rows [m0, m0 + MB) x panel p's 16 columns (fewer in the last panel) into `tile` [MB, 16], then stored.
void tile_scalar(const Problem& p, int64_t m0, int MB, int64_t panel, float* tile) {
  const float* w = p.w + panel * p.K * 16;
  for (int i = 0; i < MB; ++i) {
    const float* xr = p.x + (m0 + i) * p.K;
    for (int j = 0; j < 16; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < p.K; ++k) s += xr[k] * w[k * 16 + j];
      tile[i * 16 + j] = s;
    }
  }
}

#if VERL_X86
// One accumulator variable per register (no arrays) and plain-value arguments: compiled through a target
// attribute (the file is built for baseline x86-64), GCC kept arrays of __m256 accumulators in memory and stored
// all twelve after every k, which halved the speed (32 against 88 GFLOP/s at 32 x 3072 x 576 on an AMD EPYC).
#define VERL_ROW(i)                                                      \
  if constexpr (MB > i) {                                                \
    const __m256 a = _mm256_broadcast_ss(x + i * K + k);                 \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                           \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                           \
  }
#define VERL_OUT(i)                                                      \
  if constexpr (MB > i) {                                                \
    _mm256_storeu_ps(tile + i * 16, c##i##0);                            \
    _mm256_storeu_ps(tile + i * 16 + 8, c##i##1);                        \
  }

template <int MB>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, const int64_t K, const float* w,
                                                   float* __restrict tile, const float* next) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(w + k * 16), b1 = _mm256_loadu_ps(w + k * 16 + 8);
    VERL_ROW(0) VERL_ROW(1) VERL_ROW(2) VERL_ROW(3) VERL_ROW(4) VERL_ROW(5)
  }
  VERL_OUT(0) VERL_OUT(1) VERL_OUT(2) VERL_OUT(3) VERL_OUT(4) VERL_OUT(5)
}
#undef VERL_ROW
#undef VERL_OUT

#endif

void store(const Problem& p, int64_t m0, int MB, int64_t panel, const float* tile) {
  const int64_t n0 = panel * 16, nb = std::min<int64_t>(16, p.N - n0);
  for (int i = 0; i < MB; ++i) {
    float* o = p.out + (m0 + i) * p.N + n0;
    for (int64_t j = 0; j < nb; ++j) o[j] = tile[i * 16 + j] + (p.bias ? p.bias[n0 + j] : 0.f);
  }
}

void panel_rows(const Problem& p, int64_t panel, bool last) {
  alignas(32) float tile[6 * 16];
  const float* w = p.w + panel * p.K * 16;
  // the next panel while the first row block runs (the last one asks again for its own, harmless)
  const float* next = last ? w : w + p.K * 16;
  int64_t m = 0;
  while (m < p.M) {
    const int MB = static_cast<int>(std::min<int64_t>(6, p.M - m));
#if VERL_X86
    if (cpu_has_avx2_fma()) {
      const float* x = p.x + m * p.K;
      const float* pf = m == 0 ? next : w;
      switch (MB) {
        case 6: tile_avx2<6>(x, p.K, w, tile, pf); break;
        case 5: tile_avx2<5>(x, p.K, w, tile, pf); break;
        case 4: tile_avx2<4>(x, p.K, w, tile, pf); break;
        case 3: tile_avx2<3>(x, p.K, w, tile, pf); break;
        case 2: tile_avx2<2>(x, p.K, w, tile, pf); break;
        default: tile_avx2<1>(x, p.K, w, tile, pf); break;
      }
    } else {
      tile_scalar(p, m, MB, panel, tile);
    }
#else
    tile_scalar(p, m, MB, panel, tile);
#endif
    store(p, m, MB, panel, tile);
    m += MB;
  }
}

at::Tensor packed_linear_cpu(const at::Tensor& x_in, const at::Tensor& packed_in,
                             const std::optional<at::Tensor>& bias_in, int64_t n) {
  check_packed_linear(x_in, packed_in, bias_in, n);
  const at::Tensor x = x_in.contiguous(), packed = packed_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  Problem p{x.data_ptr<float>(), packed.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
            out.data_ptr<float>(), M, n, K};
  // a task of panels holds ~256k multiply-adds or more, so a thread's share amortises the scheduling
  const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, 16 * M * K));
  at::parallel_for(0, P, grain, [&](int64_t b, int64_t e) {
    for (int64_t panel = b; panel < e; ++panel) panel_rows(p, panel, panel + 1 == e);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
}

}  // namespace verl
