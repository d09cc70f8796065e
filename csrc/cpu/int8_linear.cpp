// CPU kernel of the int8 weight-only linear (contract in csrc/include/verl/int8_linear.h).
//
// Decoding is a product of a few rows of activations with the whole weight matrix, so its speed is the speed at
// which the weights stream from memory: reading them as int8 moves a quarter of the fp32 bytes. The kernel
// keeps everything else at fp32 speed: a block of 3 weight rows is widened int8 -> float32 in registers (8 at
// a time, AVX2) and multiplied into 4 x 3 accumulators against 4 activation rows, so each widened weight
// vector feeds 4 FMAs and each activation vector 3. Weight rows are the outer (parallel) loop: a block of them
// is read from memory once and stays in L1 while every activation row passes over it.
//
// The AVX-512 and AVX2 paths are compiled for their targets alone (function attributes) and chosen at run time
// (AVX-512 first; VERL_INT8_NO_AVX512=1 forces AVX2, which the tests use to check both), so the library still
// loads on a CPU without them, where a scalar loop computes the same sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "verl/cpu_math.h"
#include "verl/int8_linear.h"

namespace verl {
namespace {

struct Problem {
  const float* x;
  const int8_t* w;
  const float* scale;
  const float* bias;
  float* out;
  int64_t M, N, K;
};

inline float finish(const Problem& p, int64_t n, float dot) {
  return dot * p.scale[n] + (p.bias ? p.bias[n] : 0.f);
}

void block_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; ++m) {
    const float* xr = p.x + m * p.K;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = p.w + n * p.K;
      float dot = 0.f;
      for (int64_t k = 0; k < p.K; ++k) dot += xr[k] * static_cast<float>(wr[k]);
      p.out[m * p.N + n] = finish(p, n, dot);
    }
  }
}

#if VERL_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* src) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
}

// MB activation rows x NB weight rows starting at (m0, n0). 4 x 3 is the largest block whose accumulators (12),
// widened weights (3) and activation vector (1) fit AVX2's 16 registers: one more spills to the stack.
template <int MB, int NB>
__attribute__((target("avx2,fma"))) void micro(const Problem& p, int64_t m0, int64_t n0) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = p.K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = widen8(p.w + (n0 + j) * p.K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(p.x + (m0 + i) * p.K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    const float* xr = p.x + (m0 + i) * p.K;
    for (int j = 0; j < NB; ++j) {
      const int8_t* wr = p.w + (n0 + j) * p.K;
      float dot = hsum(acc[i][j]);
      for (int64_t k = K8; k < p.K; ++k) dot += xr[k] * static_cast<float>(wr[k]);
      p.out[(m0 + i) * p.N + n0 + j] = finish(p, n0 + j, dot);
    }
  }
}

template <int NB>
__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) micro<4, NB>(p, m, n0);
  switch (p.M - m) {
    case 3: micro<3, NB>(p, m, n0); break;
    case 2: micro<2, NB>(p, m, n0); break;
    case 1: micro<1, NB>(p, m, n0); break;
    default: break;
  }
}

__attribute__((target("avx2,fma"))) void block_avx2(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) rows_avx2<3>(p, n);
  switch (n1 - n) {
    case 2: rows_avx2<2>(p, n); break;
    case 1: rows_avx2<1>(p, n); break;
    default: break;
  }
}

// The same blocking with AVX-512's 32 registers and 16 lanes: 6 x 4 blocks (24 accumulators, 4 widened weights,
// one activation vector: 29 registers) and twice the weights per widening. On the EPYC this was tuned on, 6 x 4
// decoded SmolLM2's projections at M = 8..32 rows ~1.2-1.5x faster than 4 x 4.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widen16(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}

template <int MB, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void micro512(const Problem& p, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K16 = p.K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = widen16(p.w + (n0 + j) * p.K + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(p.x + (m0 + i) * p.K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    const float* xr = p.x + (m0 + i) * p.K;
    for (int j = 0; j < NB; ++j) {
      const int8_t* wr = p.w + (n0 + j) * p.K;
      float dot = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t k = K16; k < p.K; ++k) dot += xr[k] * static_cast<float>(wr[k]);
      p.out[(m0 + i) * p.N + n0 + j] = finish(p, n0 + j, dot);
    }
  }
}

template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const Problem& p, int64_t n0) {
  int64_t m = 0;
  for (; m + 6 <= p.M; m += 6) micro512<6, NB>(p, m, n0);
  switch (p.M - m) {
    case 5: micro512<5, NB>(p, m, n0); break;
    case 4: micro512<4, NB>(p, m, n0); break;
    case 3: micro512<3, NB>(p, m, n0); break;
    case 2: micro512<2, NB>(p, m, n0); break;
    case 1: micro512<1, NB>(p, m, n0); break;
    default: break;
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_avx512(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_avx512<4>(p, n);
  switch (n1 - n) {
    case 3: rows_avx512<3>(p, n); break;
    case 2: rows_avx512<2>(p, n); break;
    case 1: rows_avx512<1>(p, n); break;
    default: break;
  }
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && std::getenv("VERL_INT8_NO_AVX512") == nullptr;
  return ok;
}

#endif

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scale_in,
                           const std::optional<at::Tensor>& bias_in) {
  check_int8_linear(x_in, qweight_in, scale_in, bias_in);
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), scale = scale_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  Problem p{x.data_ptr<float>(), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(),
            bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K};
  // Tasks are multiples of 12 weight rows (whole 3-row blocks) holding ~64k multiply-adds or more, so a
  // thread's share amortises the scheduling.
  constexpr int64_t kRows = 12;
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRows * M * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
    const int64_t n0 = kRows * b, n1 = std::min(N, kRows * e);
#if VERL_X86
    if (have_avx512()) return block_avx512(p, n0, n1);
    if (cpu_has_avx2_fma()) return block_avx2(p, n0, n1);
#endif
    block_scalar(p, n0, n1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("int8_linear", &int8_linear_cpu);
}

}  // namespace verl
