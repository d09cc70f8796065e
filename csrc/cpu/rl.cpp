// CPU kernels of the RL ops: GAE, outcome (group) advantages, KL penalties, and the fused losses
// (policy, value, KL, plain aggregation) with their backward ops. Contract: csrc/ops.cpp; per-token
// math and aggregation weights: csrc/include/verl/rl.h (shared with the CUDA kernels).
//
// Work is split over rows (sequences) with at::parallel_for: every op here is a per-row pass followed by
// O(B) work, so one row stays in cache while its running sums, counts and clip statistics are formed,
// and each [B, T] input is read once. Row sums are accumulated in double.
//
// The token loops are small non-inlined functions over float (or double) chunks compiled twice with
// target_clones, for AVX2+FMA and for baseline x86-64, so one build serves any x86-64 CPU at full vector
// width where it has AVX2. FP operations here never rely on floating-point exception flags; telling GCC so
// (-fno-trapping-math for this file only) is what lets it turn the per-token selects into SIMD blends.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "verl/checks.h"
#include "verl/rl.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#define VERL_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VERL_SIMD_CLONES
#endif
#if defined(__GNUC__)
// Token lambdas and loop templates are forced inline into the cloned chunk functions: only inlined code is
// compiled for the clone's ISA.
#define VERL_INLINE inline __attribute__((always_inline))
#define VERL_INLINE_LAMBDA __attribute__((always_inline))
#else
#define VERL_INLINE inline
#define VERL_INLINE_LAMBDA
#endif

namespace verl {
namespace {

using namespace verl::rl;

constexpr int64_t kGrain = 32768;
constexpr int64_t kChunk = 512;  // tokens per chunk of a token loop: 2 KiB of float per input, stays in L1

int64_t row_grain(int64_t T) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(T, 1)); }

struct RowAcc {
  double sum = 0.0, s0 = 0.0, s1 = 0.0, s2 = 0.0;  // s*: per-op statistics
};

// Compute type of the token loops: double for float64 inputs, float otherwise.
template <typename scalar_t>
using comp_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// ------------------------------------------------------------------------------------------ vector helpers

typedef uint32_t u32_alias __attribute__((may_alias));

// bfloat16 <-> float through bit patterns (vectorises; c10's scalar conversions do not).
VERL_SIMD_CLONES void load_chunk(const c10::BFloat16* x, float* out, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  u32_alias* o = reinterpret_cast<u32_alias*>(out);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<uint32_t>(u[j]) << 16;
}

// Round to nearest even, NaN -> quiet NaN: the same results as c10::BFloat16(float).
VERL_SIMD_CLONES void store_chunk(const float* in, c10::BFloat16* x, int64_t n) {
  const u32_alias* u = reinterpret_cast<const u32_alias*>(in);
  uint16_t* o = reinterpret_cast<uint16_t*>(x);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = u[j];
    const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    o[j] = in[j] != in[j] ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
  }
}

void load_chunk(const c10::Half* x, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(x[j]);
}

void store_chunk(const float* in, c10::Half* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = static_cast<c10::Half>(in[j]);
}

// Valid entries of a bool row: 8 mask bytes (each 0 or 1) at a time, summed by one multiply (byte sums <= 8
// cannot carry); ~7x faster than GCC's vectorised byte reduction here.
int64_t count_valid(const bool* m, int64_t n) {
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
  int64_t total = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, m8 + j, sizeof(w));
    total += static_cast<int64_t>((w * 0x0101010101010101ull) >> 56);
  }
  for (; j < n; ++j) total += m8[j] != 0 ? 1 : 0;
  return total;
}

// out[j] = m[j] ? v : 0 on bit patterns of any float type (0 bits = +0.0).
template <typename U>
VERL_INLINE void select_fill_impl(const bool* m, int64_t n, U v, U* out) {
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<U>(v & static_cast<U>(U(0) - static_cast<U>(m8[j] != 0)));
}
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint16_t v, uint16_t* out) { select_fill_impl(m, n, v, out); }
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint32_t v, uint32_t* out) { select_fill_impl(m, n, v, out); }
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint64_t v, uint64_t* out) { select_fill_impl(m, n, v, out); }

// Sum of valid x in double and the count of valid non-finite x (x - x is NaN exactly for NaN and inf).
template <typename T>
VERL_INLINE void masked_sum_nonfinite_impl(const T* x, const bool* m, int64_t n, double* sum, int64_t* bad) {
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
  double s = 0.0;
  uint64_t nb = 0;
#pragma omp simd reduction(+ : s, nb)
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t keep = uint64_t(0) - static_cast<uint64_t>(m8[j] != 0);
    const double xd = static_cast<double>(x[j]);
    s += std::bit_cast<double>(std::bit_cast<uint64_t>(xd) & keep);
    nb += keep & static_cast<uint64_t>(!(xd - xd == 0.0));
  }
  *sum += s;
  *bad += static_cast<int64_t>(nb);
}
VERL_SIMD_CLONES void masked_sum_nonfinite(const float* x, const bool* m, int64_t n, double* sum, int64_t* bad) {
  masked_sum_nonfinite_impl(x, m, n, sum, bad);
}
void masked_sum_nonfinite(const double* x, const bool* m, int64_t n, double* sum, int64_t* bad) {
  masked_sum_nonfinite_impl(x, m, n, sum, bad);
}

// Whitening in place: a = m ? (a - mean) * rstd : 0.
template <typename T>
VERL_INLINE void whiten_chunk_impl(T* a, const bool* m, int64_t n, T mean, T rstd) {
  using K = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
  alignas(64) K mk[kChunk];  // widened first: a loop mixing byte and float lanes vectorises poorly
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t len = std::min<int64_t>(kChunk, n - j0);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) mk[j] = K(0) - static_cast<K>(m8[j0 + j] != 0);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      a[j0 + j] = std::bit_cast<T>(static_cast<K>(std::bit_cast<K>((a[j0 + j] - mean) * rstd) & mk[j]));
  }
}
VERL_SIMD_CLONES void whiten_chunk(float* a, const bool* m, int64_t n, float mean, float rstd) {
  whiten_chunk_impl(a, m, n, mean, rstd);
}
void whiten_chunk(double* a, const bool* m, int64_t n, double mean, double rstd) {
  whiten_chunk_impl(a, m, n, mean, rstd);
}

// ------------------------------------------------------------------------------------------ GAE

// Per-row results of the scan: the non-finite count and (for whitening) the row's count, mean and centred
// sum of squares of the raw advantages, combined across rows with Chan's formula (no cancellation between
// rows whose means differ).
struct ScanStats {
  int64_t bad = 0;
  double n = 0.0, mean = 0.0, m2 = 0.0;
};

template <typename T>
struct GaeState {
  T next_v = 0, run = 0;  // carried across chunks of a row
  int64_t bad = 0;
  double s = 0.0, q = 0.0, n = 0.0;  // sum, sum of squares and count of the valid advantages
};

// Reverse scan over [0, len) of a row (continuing `st` from the positions after it), over the valid positions
// only: a masked position neither updates the running advantage nor the next value, so left/right padding and
// holes leave the valid outputs unchanged. The statistics are of the advantages rounded to the output dtype R
// (what whitening then reads), so a constant advantage whitens to exactly 0.
template <typename R, typename T, typename O>
VERL_INLINE void gae_span(const T* rp, const T* vp, const bool* mp, int64_t len, T g, T gl, GaeState<T>& st, O* ap,
                          O* tp) {
  for (int64_t t = len - 1; t >= 0; --t) {
    if (!mp[t]) {
      ap[t] = O(0);
      tp[t] = O(0);
      continue;
    }
    const T rt = rp[t];
    const T vt = vp ? vp[t] : T(0);
    st.bad += (std::isfinite(rt) && std::isfinite(vt)) ? 0 : 1;
    st.run = rt + g * st.next_v - vt + gl * st.run;
    st.next_v = vt;
    ap[t] = static_cast<O>(st.run);
    tp[t] = static_cast<O>(st.run + vt);
    const double o = static_cast<double>(static_cast<R>(st.run));
    st.s += o;
    st.q += o * o;
    st.n += 1.0;
  }
}

template <typename T>
ScanStats finish_scan(const GaeState<T>& st) {
  ScanStats out;
  out.bad = st.bad;
  out.n = st.n;
  out.mean = st.n > 0.0 ? st.s / st.n : 0.0;
  out.m2 = st.n > 0.0 ? std::max(0.0, st.q - st.s * out.mean) : 0.0;
  return out;
}

// One row: float32 / float64 in place; bf16 / half through float chunks (vectorised conversions), from the end.
template <typename scalar_t>
ScanStats gae_row(const scalar_t* rp, const scalar_t* vp, const bool* mp, int64_t T, double gamma, double lam,
                  scalar_t* ap, scalar_t* tp) {
  using T_ = comp_t<scalar_t>;
  const T_ g = static_cast<T_>(gamma), gl = static_cast<T_>(gamma * lam);
  GaeState<T_> st;
  if constexpr (std::is_same_v<scalar_t, T_>) {
    gae_span<scalar_t>(rp, vp, mp, T, g, gl, st, ap, tp);
  } else {
    T_ rb[kChunk], vb[kChunk], ab[kChunk], tb[kChunk];
    for (int64_t end = T; end > 0; end -= kChunk) {
      const int64_t t0 = std::max<int64_t>(0, end - kChunk), len = end - t0;
      load_chunk(rp + t0, rb, len);
      if (vp) load_chunk(vp + t0, vb, len);
      gae_span<scalar_t>(rb, vp ? vb : nullptr, mp + t0, len, g, gl, st, ab, tb);
      store_chunk(ab, ap + t0, len);
      store_chunk(tb, tp + t0, len);
    }
  }
  return finish_scan(st);
}

// ---- GAE, 8 rows per AVX2 vector
//
// The scan is serial in t, so one row per thread is latency-bound (~5 cycles per token on the fma + select chain).
// Here 8 rows advance together, one per vector lane: blocks of 8 rows x 8 timesteps are loaded row-wise,
// transposed in registers (8x8), scanned as 8 vector steps backwards in time, transposed back and stored. Only
// compiled for AVX2+FMA and used when the CPU has it (gae_rows8 below); other CPUs take the row scan.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#define VERL_HAVE_GAE8 1
#define VERL_AVX2 __attribute__((target("avx2,fma")))
#define VERL_AVX2_INLINE inline __attribute__((target("avx2,fma"), always_inline))

VERL_AVX2_INLINE void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

template <typename S>
VERL_AVX2_INLINE __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bf16: the high half of a float
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// float -> bf16 bits (round to nearest even, NaN -> 0x7FC0) in the low 16 bits of each 32-bit lane.
VERL_AVX2_INLINE __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

template <typename S>
VERL_AVX2_INLINE void store8(S* p, __m256 x) {
  if constexpr (std::is_same_v<S, float>) {
    _mm256_storeu_ps(p, x);
  } else {
    const __m256i b = bf16_bits(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
}

// The value whitening will read back: x rounded to the output dtype.
template <typename S>
VERL_AVX2_INLINE __m256 as_stored(__m256 x) {
  if constexpr (std::is_same_v<S, float>) return x;
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
}

VERL_AVX2_INLINE __m256 load_mask8(const bool* m) {
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(w, _mm256_setzero_si256()));
}

// Rows [0, 8) starting at rp / vp / mp / ap / tp (row stride T). Blocks of 8 timesteps from the end; the first
// T % 8 timesteps of each row finish in the scalar scan, continuing each lane's state.
template <typename S>
VERL_AVX2 void gae_group8(const S* rp, const S* vp, const bool* mp, int64_t T, float gamma, float gl, S* ap, S* tp,
                          ScanStats* out) {
  const __m256 G = _mm256_set1_ps(gamma), GL = _mm256_set1_ps(gl), zero = _mm256_setzero_ps();
  __m256 nv = zero, run = zero;
  __m256i nbad = _mm256_setzero_si256(), cnt = _mm256_setzero_si256();
  __m256d s_lo = _mm256_setzero_pd(), s_hi = s_lo, q_lo = s_lo, q_hi = s_lo;
  const int64_t head = T % 8;
  for (int64_t tb = T - 8; tb >= head; tb -= 8) {
    __m256 R[8], V[8], M[8];
    for (int r = 0; r < 8; ++r) {
      R[r] = load8(rp + r * T + tb);
      V[r] = vp ? load8(vp + r * T + tb) : zero;
      M[r] = load_mask8(mp + r * T + tb);
    }
    transpose8(R);
    transpose8(V);
    transpose8(M);
    for (int j = 7; j >= 0; --j) {
      const __m256 keep = M[j];
      const __m256 nw = _mm256_fmadd_ps(GL, run, _mm256_sub_ps(_mm256_fmadd_ps(G, nv, R[j]), V[j]));
      run = _mm256_blendv_ps(run, nw, keep);
      nv = _mm256_blendv_ps(nv, V[j], keep);
      const __m256 fin = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(R[j], R[j]), zero, _CMP_EQ_OQ),
                                       _mm256_cmp_ps(_mm256_sub_ps(V[j], V[j]), zero, _CMP_EQ_OQ));
      nbad = _mm256_sub_epi32(nbad, _mm256_castps_si256(_mm256_andnot_ps(fin, keep)));
      cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(keep));
      const __m256 a = _mm256_and_ps(nw, keep);
      R[j] = a;  // R and V now hold the outputs of step j
      V[j] = _mm256_and_ps(_mm256_add_ps(nw, V[j]), keep);
      // Sums in double per step: float partial sums lose the variance of advantages with a large common offset.
      const __m256 st = as_stored<S>(a);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(st)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(st, 1));
      s_lo = _mm256_add_pd(s_lo, lo);
      s_hi = _mm256_add_pd(s_hi, hi);
      q_lo = _mm256_fmadd_pd(lo, lo, q_lo);
      q_hi = _mm256_fmadd_pd(hi, hi, q_hi);
    }
    transpose8(R);
    transpose8(V);
    for (int r = 0; r < 8; ++r) {
      store8(ap + r * T + tb, R[r]);
      store8(tp + r * T + tb, V[r]);
    }
  }
  alignas(32) float nvl[8], runl[8];
  alignas(32) int32_t badl[8], cntl[8];
  alignas(32) double sl[8], ql[8];
  _mm256_store_ps(nvl, nv);
  _mm256_store_ps(runl, run);
  _mm256_store_si256(reinterpret_cast<__m256i*>(badl), nbad);
  _mm256_store_si256(reinterpret_cast<__m256i*>(cntl), cnt);
  _mm256_store_pd(sl, s_lo);
  _mm256_store_pd(sl + 4, s_hi);
  _mm256_store_pd(ql, q_lo);
  _mm256_store_pd(ql + 4, q_hi);
  for (int r = 0; r < 8; ++r) {
    GaeState<float> st;
    st.next_v = nvl[r];
    st.run = runl[r];
    st.bad = badl[r];
    st.s = sl[r];
    st.q = ql[r];
    st.n = cntl[r];
    if (head > 0) {
      float rb[8], vb[8], ab[8], tb[8];
      for (int64_t t = 0; t < head; ++t) {
        rb[t] = static_cast<float>(rp[r * T + t]);
        vb[t] = vp ? static_cast<float>(vp[r * T + t]) : 0.0f;
      }
      gae_span<S>(rb, vp ? vb : nullptr, mp + r * T, head, gamma, gl, st, ab, tb);
      for (int64_t t = 0; t < head; ++t) {
        ap[r * T + t] = static_cast<S>(ab[t]);
        tp[r * T + t] = static_cast<S>(tb[t]);
      }
    }
    out[r] = finish_scan(st);
  }
}

bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// Scans rows [0, 8 * (B / 8)) in groups of 8 when the CPU has AVX2+FMA; returns how many rows it did.
template <typename S>
int64_t gae_rows8(const S* rp, const S* vp, const bool* mp, int64_t B, int64_t T, double gamma, double lam, S* ap,
                  S* tp, std::vector<ScanStats>& rows) {
  if constexpr (!(std::is_same_v<S, float> || std::is_same_v<S, c10::BFloat16>)) {
    return 0;
  } else {
    if (!cpu_has_avx2_fma() || T < 8) return 0;
    const int64_t groups = B / 8;
    const float g = static_cast<float>(gamma), gl = static_cast<float>(gamma * lam);
    at::parallel_for(0, groups, std::max<int64_t>(1, row_grain(T) / 8), [&](int64_t g0, int64_t g1) {
      for (int64_t k = g0; k < g1; ++k) {
        const int64_t off = k * 8 * T;
        gae_group8(rp + off, vp ? vp + off : nullptr, mp + off, T, g, gl, ap + off, tp + off, rows.data() + k * 8);
      }
    });
    return groups * 8;
  }
}
#endif

struct GaeOut {
  at::Tensor adv, ret, m;
  std::vector<ScanStats> rows;
};

GaeOut gae_scan(const at::Tensor& rewards, const std::optional<at::Tensor>& values, const at::Tensor& mask,
                double gamma, double lam, const char* op) {
  check_bt(rewards, op, "rewards");
  if (values) check_like(rewards, *values, op, "rewards", "values");
  check_mask_of(rewards, mask, op, "rewards");
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": `gamma` must be in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, op, ": `lam` must be in [0, 1], got ", lam);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const at::Tensor r = rewards.contiguous();
  const at::Tensor v = values ? values->contiguous() : at::Tensor();
  GaeOut o;
  o.m = mask_as_bool(mask);
  o.adv = at::empty({B, T}, rewards.options());
  o.ret = at::empty({B, T}, rewards.options());
  o.rows.resize(B);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_gae", [&] {
    const scalar_t* rp = r.data_ptr<scalar_t>();
    const scalar_t* vp = values ? v.data_ptr<scalar_t>() : nullptr;
    const bool* mp = o.m.data_ptr<bool>();
    scalar_t* ap = o.adv.data_ptr<scalar_t>();
    scalar_t* tp = o.ret.data_ptr<scalar_t>();
    int64_t done = 0;
#if VERL_HAVE_GAE8
    done = gae_rows8(rp, vp, mp, B, T, gamma, lam, ap, tp, o.rows);
#endif
    at::parallel_for(done, B, row_grain(T), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t off = b * T;
        o.rows[b] = gae_row(rp + off, vp ? vp + off : nullptr, mp + off, T, gamma, lam, ap + off, tp + off);
      }
    });
  });
  return o;
}

at::Tensor total_bad(const std::vector<ScanStats>& rows, const at::Tensor& like) {
  int64_t bad = 0;
  for (const ScanStats& s : rows) bad += s.bad;
  return at::scalar_tensor(bad, like.options().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const std::optional<at::Tensor>& values,
                                                       const at::Tensor& mask, double gamma, double lam) {
  GaeOut o = gae_scan(rewards, values, mask, gamma, lam, "gae");
  return {o.adv, o.ret, total_bad(o.rows, rewards)};
}

// a = m ? (a - mean) * rstd : 0 in place over [B, T], chunk by chunk in the compute type.
template <typename scalar_t>
void whiten_rows(scalar_t* ap, const bool* mp, int64_t B, int64_t T, double mean, double rstd) {
  using T_ = comp_t<scalar_t>;
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    T_ buf[std::is_same_v<scalar_t, T_> ? 1 : kChunk];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t len = std::min<int64_t>(kChunk, T - t0), base = b * T + t0;
        if constexpr (std::is_same_v<scalar_t, T_>) {
          whiten_chunk(ap + base, mp + base, len, static_cast<T_>(mean), static_cast<T_>(rstd));
        } else {
          load_chunk(ap + base, buf, len);
          whiten_chunk(buf, mp + base, len, static_cast<T_>(mean), static_cast<T_>(rstd));
          store_chunk(buf, ap + base, len);
        }
      }
    }
  });
}

// GAE with the advantages whitened over the mask (masked_whiten: mean 0, unbiased variance, eps inside the
// square root). The statistics come out of the scan, so whitening is one extra in-place elementwise pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_whitened_cpu(const at::Tensor& rewards,
                                                                const std::optional<at::Tensor>& values,
                                                                const at::Tensor& mask, double gamma, double lam,
                                                                double eps) {
  const char* op = "gae_whitened";
  TORCH_CHECK(eps >= 0.0, op, ": `eps` must be >= 0, got ", eps);
  GaeOut o = gae_scan(rewards, values, mask, gamma, lam, op);
  double n = 0.0, mean = 0.0, m2 = 0.0;
  for (const ScanStats& s : o.rows) {  // Chan et al.: merge (n, mean, M2) of row after row
    if (s.n == 0.0) continue;
    const double tot = n + s.n, d = s.mean - mean;
    mean += d * s.n / tot;
    m2 += s.m2 + d * d * n * s.n / tot;
    n = tot;
  }
  const double var = n > 1.0 ? m2 / (n - 1.0) : 0.0;
  const double rstd = 1.0 / std::sqrt(var + eps);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const bool* mp = o.m.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_gae_whiten", [&] {
    whiten_rows(o.adv.data_ptr<scalar_t>(), mp, B, T, mean, rstd);
  });
  return {o.adv, o.ret, total_bad(o.rows, rewards)};
}
// ------------------------------------------------------------------------------------------ outcome advantages

// Dense group ids 0..G-1 for arbitrary int64 prompt ids, in order of first appearance.
std::vector<int64_t> dense_groups(const at::Tensor& index, int64_t& num_groups) {
  const at::Tensor idx = index.to(at::kLong).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::unordered_map<int64_t, int64_t> ids;
  ids.reserve(static_cast<size_t>(idx.numel()) * 2);
  std::vector<int64_t> dense(idx.numel());
  for (int64_t i = 0; i < idx.numel(); ++i) dense[i] = ids.emplace(ip[i], static_cast<int64_t>(ids.size())).first->second;
  num_groups = static_cast<int64_t>(ids.size());
  return dense;
}

// Per-sequence advantages: group sums, counts and centered squares (O(B), serial), then rl::group_advantage.
std::vector<double> outcome_scores_to_adv(const std::vector<double>& s, const std::vector<int64_t>& gid, int64_t G,
                                          Outcome est, double eps, bool norm_by_std) {
  const size_t B = s.size();
  std::vector<double> sum(G, 0.0), cnt(G, 0.0), sq(G, 0.0), adv(B, 0.0);
  for (size_t b = 0; b < B; ++b) {
    sum[gid[b]] += s[b];
    cnt[gid[b]] += 1.0;
  }
  for (size_t b = 0; b < B; ++b) {
    const double d = s[b] - sum[gid[b]] / cnt[gid[b]];
    sq[gid[b]] += d * d;
  }
  for (size_t b = 0; b < B; ++b) {
    const int64_t g = gid[b];
    adv[b] = group_advantage(est, s[b], sum[g], cnt[g], sq[g], eps, norm_by_std);
  }
  return adv;
}

// score[b] = sum of the row's valid rewards (double); bad[b] = its valid non-finite rewards.
template <typename scalar_t>
void row_scores(const scalar_t* rp, const bool* mp, int64_t B, int64_t T, std::vector<double>& score,
                std::vector<int64_t>& bad) {
  using T_ = comp_t<scalar_t>;
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    T_ buf[std::is_same_v<scalar_t, T_> ? 1 : kChunk];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t n = std::min<int64_t>(kChunk, T - t0), base = b * T + t0;
        if constexpr (std::is_same_v<scalar_t, T_>) {
          masked_sum_nonfinite(rp + base, mp + base, n, &score[b], &bad[b]);
        } else {
          load_chunk(rp + base, buf, n);
          masked_sum_nonfinite(buf, mp + base, n, &score[b], &bad[b]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> outcome_advantage_cpu(const at::Tensor& rewards, const at::Tensor& mask,
                                                         const at::Tensor& index, c10::string_view estimator,
                                                         double eps, bool norm_by_std,
                                                         const std::optional<at::Tensor>& baseline) {
  const char* op = "outcome_advantage";
  const Outcome est = parse_outcome(estimator, op);
  const at::Tensor base = check_outcome_inputs(rewards, mask, index, est, estimator, eps, baseline, op);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const at::Tensor r = rewards.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  std::vector<double> score(B, 0.0);
  std::vector<int64_t> bad(B, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_outcome_scores", [&] {
    row_scores(r.data_ptr<scalar_t>(), m.data_ptr<bool>(), B, T, score, bad);
  });
  if (baseline) {
    const double* bp = base.data_ptr<double>();
    for (int64_t b = 0; b < B; ++b) {
      bad[b] += std::isfinite(bp[b]) ? 0 : 1;
      score[b] -= bp[b];
    }
  }
  int64_t G = 0;
  const std::vector<int64_t> gid = dense_groups(index, G);
  const std::vector<double> adv_b = outcome_scores_to_adv(score, gid, G, est, eps, norm_by_std);
  at::Tensor adv = at::empty({B, T}, rewards.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_outcome_broadcast", [&] {
    using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t,
                                      std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>>;
    const bool* mp = m.data_ptr<bool>();
    bits_t* ap = reinterpret_cast<bits_t*>(adv.data_ptr<scalar_t>());
    at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t a = static_cast<scalar_t>(adv_b[b]);
        bits_t bits;
        std::memcpy(&bits, &a, sizeof(bits));
        select_fill(mp + b * T, T, bits, ap + b * T);
      }
    });
  });
  int64_t total_bad = 0;
  for (int64_t x : bad) total_bad += x;
  return {adv, at::scalar_tensor(total_bad, rewards.options().dtype(at::kLong))};
}

// ------------------------------------------------------------------------------------------ KL penalty

// out[i] = f(i) over [0, n), vectorised and split across threads.
template <typename scalar_t, typename F>
void elementwise(int64_t n, scalar_t* out, const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) out[i] = static_cast<scalar_t>(f(i));
  });
}

at::Tensor kl_penalty_cpu(const at::Tensor& logprob, const at::Tensor& ref_logprob, c10::string_view kind) {
  const char* op = "kl_penalty";
  const Kl k = parse_kl(kind, op);
  check_floating(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  const at::Tensor a = logprob.contiguous(), b = ref_logprob.contiguous();
  at::Tensor out = at::empty(logprob.sizes(), logprob.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    kl_switch(k, [&](auto kind) {
      constexpr Kl kKind = decltype(kind)::value;
      elementwise(a.numel(), op_, [=](int64_t i) {
        return kl_token_t<kKind, acc_t>(static_cast<acc_t>(ap[i]), static_cast<acc_t>(bp[i])).value;
      });
    });
  });
  return out;
}

at::Tensor kl_penalty_backward_cpu(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                   c10::string_view kind) {
  const char* op = "kl_penalty_backward";
  const Kl k = parse_kl(kind, op);
  check_floating(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  check_same_shape(logprob, grad, op, "logprob", "grad");
  const at::Tensor a = logprob.contiguous(), b = ref_logprob.contiguous();
  const at::Tensor g = grad.to(logprob.scalar_type()).contiguous();
  at::Tensor out = at::empty(logprob.sizes(), logprob.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    kl_switch(k, [&](auto kind) {
      constexpr Kl kKind = decltype(kind)::value;
      elementwise(a.numel(), op_, [=](int64_t i) {
        return static_cast<acc_t>(gp[i]) *
               kl_token_t<kKind, acc_t>(static_cast<acc_t>(ap[i]), static_cast<acc_t>(bp[i])).grad;
      });
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------ losses
//
// Every loss op is one chunk kernel per loss type, run over kChunk tokens of a row at a time: a pure map of
// the rl.h token math with masked sums of (loss, statistics) and, when asked, the token gradients
// grad[j] = mask ? w_b * d loss / d x : 0 in the same loop. The chunk kernels compute in float (float32 in
// place; bf16 / half converted chunk-wise through L1 buffers) or double, and are compiled twice, for
// AVX2+FMA and for baseline x86-64 (target_clones: the loader picks one per CPU).
//
// The row weights w_b of every aggregation depend on the mask only, so a byte-count pre-pass over the mask
// gives them before the token pass. That lets the *_with_grad ops write the finished d loss / d x during
// the forward pass: forward + backward read the inputs once, and the backward op only scales the saved
// gradient by the incoming scalar.

template <typename T>
struct Sums {
  T loss = 0, s0 = 0, s1 = 0, s2 = 0;
};

template <typename T>
struct TokOut {
  T loss, grad, s0, s1, s2;  // grad = d loss / d x; s*: per-op statistics (0/1 indicators, ppo_kl term)
};

// Bit masks of a compute type's width: all ones where valid, 0 where masked.
template <typename T>
using mask_bits_t = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;

// x where k is all ones, +0.0 where k is 0: a bitwise AND, so NaN/garbage under the mask never enters a sum or a
// gradient (a product with 0 would keep NaN), and no per-element branch or byte-width select is left for the
// vectoriser: with every operand 32 (64) bits wide, GCC uses full-width vectors without spilling.
template <typename T>
VERL_INLINE T sel(T x, mask_bits_t<T> k) {
  return std::bit_cast<T>(static_cast<mask_bits_t<T>>(std::bit_cast<mask_bits_t<T>>(x) & k));
}

// Masked sums of (loss, statistics) and, with kGrad, grad[j] = valid ? w * d loss / d x : 0, in one loop.
template <bool kGrad, typename T, typename Tok>
VERL_INLINE Sums<T> chunk_loop(int64_t n, const bool* m, T w, T* grad, const Tok& tok) {
  using K = mask_bits_t<T>;
  alignas(64) K mk[kChunk];
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) mk[j] = K(0) - static_cast<K>(m8[j] != 0);
  T sum = 0, s0 = 0, s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : sum, s0, s1, s2)
  for (int64_t j = 0; j < n; ++j) {
    const TokOut<T> k = tok(j);
    const K keep = mk[j];
    sum += sel(k.loss, keep);
    s0 += sel(k.s0, keep);
    s1 += sel(k.s1, keep);
    s2 += sel(k.s2, keep);
    if constexpr (kGrad) grad[j] = sel(w * k.grad, keep);
  }
  return {sum, s0, s1, s2};
}

template <typename T, typename Tok>
VERL_INLINE Sums<T> chunk_any(int64_t n, const bool* m, T w, T* grad, const Tok& tok) {
  return grad ? chunk_loop<true, T>(n, m, w, grad, tok) : chunk_loop<false, T>(n, m, w, grad, tok);
}

// ---- per-loss chunk kernels (float: cloned per ISA; double: plain)

template <Pg kType, typename T>
VERL_INLINE Sums<T> pg_chunk_t(const T* lp, const T* olp, const T* adv, T seq_lr, const bool* m, int64_t n,
                               const PgParams& p, T w, T* grad) {
  return chunk_any<T>(n, m, w, grad, [&](int64_t j) VERL_INLINE_LAMBDA {
    const T d = lp[j] - olp[j];
    const PgToken<T> k = pg_token_t<kType, T>(kType == Pg::Gspo ? seq_lr : d, adv[j], p);
    // ppo_kl = mean(old - logp), with the same +-20 clamp as the ratio.
    return TokOut<T>{k.loss, k.grad, k.clipped, k.lower, -clampv(d, T(-20), T(20))};
  });
}

template <typename T>
VERL_INLINE Sums<T> pg_chunk_impl(Pg type, const T* lp, const T* olp, const T* adv, T seq_lr, const bool* m,
                                  int64_t n, const PgParams& p, T w, T* grad) {
  switch (type) {
    case Pg::Gspo:
      return pg_chunk_t<Pg::Gspo, T>(lp, olp, adv, seq_lr, m, n, p, w, grad);
    case Pg::Reinforce:
      return pg_chunk_t<Pg::Reinforce, T>(lp, olp, adv, seq_lr, m, n, p, w, grad);
    default:
      return pg_chunk_t<Pg::Vanilla, T>(lp, olp, adv, seq_lr, m, n, p, w, grad);
  }
}

VERL_SIMD_CLONES Sums<float> pg_chunk(Pg type, const float* lp, const float* olp, const float* adv, float seq_lr,
                                      const bool* m, int64_t n, const PgParams& p, float w, float* grad) {
  return pg_chunk_impl<float>(type, lp, olp, adv, seq_lr, m, n, p, w, grad);
}

Sums<double> pg_chunk(Pg type, const double* lp, const double* olp, const double* adv, double seq_lr, const bool* m,
                      int64_t n, const PgParams& p, double w, double* grad) {
  return pg_chunk_impl<double>(type, lp, olp, adv, seq_lr, m, n, p, w, grad);
}

template <Kl kKind, typename T>
VERL_INLINE Sums<T> kl_chunk_t(const T* lp, const T* ref, const bool* m, int64_t n, T w, T* grad) {
  return chunk_any<T>(n, m, w, grad, [&](int64_t j) VERL_INLINE_LAMBDA {
    const ValGrad<T> k = kl_token_t<kKind, T>(lp[j], ref[j]);
    return TokOut<T>{k.value, k.grad, T(0), T(0), T(0)};
  });
}

template <typename T>
VERL_INLINE Sums<T> kl_chunk_impl(Kl kind, const T* lp, const T* ref, const bool* m, int64_t n, T w, T* grad) {
  switch (kind) {
    case Kl::K1:
      return kl_chunk_t<Kl::K1, T>(lp, ref, m, n, w, grad);
    case Kl::Abs:
      return kl_chunk_t<Kl::Abs, T>(lp, ref, m, n, w, grad);
    case Kl::K2:
      return kl_chunk_t<Kl::K2, T>(lp, ref, m, n, w, grad);
    case Kl::K1Plus:
      return kl_chunk_t<Kl::K1Plus, T>(lp, ref, m, n, w, grad);
    case Kl::K3Plus:
      return kl_chunk_t<Kl::K3Plus, T>(lp, ref, m, n, w, grad);
    default:
      return kl_chunk_t<Kl::K3, T>(lp, ref, m, n, w, grad);
  }
}

VERL_SIMD_CLONES Sums<float> kl_chunk(Kl kind, const float* lp, const float* ref, const bool* m, int64_t n, float w,
                                      float* grad) {
  return kl_chunk_impl<float>(kind, lp, ref, m, n, w, grad);
}

Sums<double> kl_chunk(Kl kind, const double* lp, const double* ref, const bool* m, int64_t n, double w,
                      double* grad) {
  return kl_chunk_impl<double>(kind, lp, ref, m, n, w, grad);
}

template <typename T>
VERL_INLINE Sums<T> vf_chunk_impl(const T* v, const T* ov, const T* ret, T clip, const bool* m, int64_t n, T w,
                                  T* grad) {
  return chunk_any<T>(n, m, w, grad, [&](int64_t j) VERL_INLINE_LAMBDA {
    const VfToken<T> k = vf_token<T>(v[j], ov[j], ret[j], clip);
    return TokOut<T>{k.loss, k.grad, k.clipped, T(0), T(0)};
  });
}

VERL_SIMD_CLONES Sums<float> vf_chunk(const float* v, const float* ov, const float* ret, float clip, const bool* m,
                                      int64_t n, float w, float* grad) {
  return vf_chunk_impl<float>(v, ov, ret, clip, m, n, w, grad);
}

Sums<double> vf_chunk(const double* v, const double* ov, const double* ret, double clip, const bool* m, int64_t n,
                      double w, double* grad) {
  return vf_chunk_impl<double>(v, ov, ret, clip, m, n, w, grad);
}

template <typename T>
VERL_INLINE Sums<T> sum_chunk_impl(const T* x, const bool* m, int64_t n) {
  return chunk_loop<false, T>(n, m, T(0), nullptr, [&](int64_t j) VERL_INLINE_LAMBDA {
    return TokOut<T>{x[j], T(0), T(0), T(0), T(0)};
  });
}

VERL_SIMD_CLONES Sums<float> sum_chunk(const float* x, const bool* m, int64_t n) { return sum_chunk_impl(x, m, n); }
Sums<double> sum_chunk(const double* x, const bool* m, int64_t n) { return sum_chunk_impl(x, m, n); }

// ---- row driver

// Calls chunk(b, inputs as comp_t pointers, mask, n, w_b * gscale, grad or nullptr) over every row in kChunk
// pieces and returns per-row double sums. grad (may be null) receives the chunk kernel's gradients.
template <typename scalar_t, size_t kIn, typename Chunk>
std::vector<RowAcc> loss_pass(const std::array<const scalar_t*, kIn>& in, const bool* mp, int64_t B, int64_t T,
                              const double* w, double gscale, scalar_t* grad, const Chunk& chunk) {
  using T_ = comp_t<scalar_t>;
  constexpr bool kSame = std::is_same_v<scalar_t, T_>;
  std::vector<RowAcc> acc(B);
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    T_ buf[kIn][kSame ? 1 : kChunk];
    T_ gbuf[kSame ? 1 : kChunk];
    for (int64_t b = b0; b < b1; ++b) {
      RowAcc a;
      const T_ wb = static_cast<T_>(w[b] * gscale);
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t n = std::min<int64_t>(kChunk, T - t0), base = b * T + t0;
        std::array<const T_*, kIn> p;
        for (size_t k = 0; k < kIn; ++k) {
          if constexpr (kSame) {
            p[k] = in[k] + base;
          } else {
            load_chunk(in[k] + base, buf[k], n);
            p[k] = buf[k];
          }
        }
        T_* g = nullptr;
        if (grad) {
          if constexpr (kSame) g = grad + base;
          else g = gbuf;
        }
        const Sums<T_> s = chunk(b, p, mp + base, n, wb, g);
        if constexpr (!kSame) {
          if (grad) store_chunk(gbuf, grad + base, n);
        }
        a.sum += static_cast<double>(s.loss);
        a.s0 += static_cast<double>(s.s0);
        a.s1 += static_cast<double>(s.s1);
        a.s2 += static_cast<double>(s.s2);
      }
      acc[b] = a;
    }
  });
  return acc;
}

// Row weights from the mask alone (one pass over its bytes), so they are known before the token pass.
struct Weights {
  std::vector<double> count, w;
  double tokens = 0.0;  // this batch's valid tokens (the statistics' denominator)
};

Weights row_weights(const bool* mp, int64_t B, int64_t T, AggParams p) {
  Weights r;
  r.count.assign(B, 0.0);
  r.w.assign(B, 0.0);
  at::parallel_for(0, B, row_grain(T) * 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) r.count[b] = static_cast<double>(count_valid(mp + b * T, T));
  });
  double seqs = 0.0;
  for (double c : r.count) {
    r.tokens += c;
    seqs += c > 0.0 ? 1.0 : 0.0;
  }
  fill_local_counts(p, r.tokens, seqs);
  for (int64_t b = 0; b < B; ++b) r.w[b] = row_weight(p, r.count[b]);
  return r;
}

// The forward outputs: loss = sum_b w_b * row sum_b (in the loss dtype); statistics are token means (float32).
struct Reduced {
  at::Tensor loss, row_weight, grad;
  double tokens = 0.0, s0 = 0.0, s1 = 0.0, s2 = 0.0;
};

Reduced finish(const std::vector<RowAcc>& acc, const Weights& wt, const at::Tensor& like) {
  Reduced r;
  r.tokens = wt.tokens;
  double loss = 0.0;
  for (size_t b = 0; b < acc.size(); ++b) {
    if (wt.w[b] != 0.0) loss += wt.w[b] * acc[b].sum;
    r.s0 += acc[b].s0;
    r.s1 += acc[b].s1;
    r.s2 += acc[b].s2;
  }
  r.loss = at::scalar_tensor(loss, like.options());
  r.row_weight = at::tensor(wt.w, like.options().dtype(at::kDouble));
  return r;
}

at::Tensor stat_tensor(double total, double tokens, const at::Tensor& like) {
  return at::scalar_tensor(tokens > 0.0 ? total / tokens : 0.0, like.options().dtype(at::kFloat));
}

double grad_scalar(const at::Tensor& grad) {
  TORCH_CHECK(grad.numel() == 1, "RL loss backward: `grad` must be the gradient of the scalar loss, got shape ",
              grad.sizes());
  return grad.to(at::kDouble).item<double>();
}

// One forward (optionally writing d loss / d x into a new [B, T] tensor), or one backward pass
// (w = saved row weights, gscale = incoming gradient; sums discarded).
template <typename scalar_t, size_t kIn, typename Chunk>
Reduced run_forward(const std::array<at::Tensor, kIn>& in, const at::Tensor& m, const AggParams& p, bool with_grad,
                    const Chunk& chunk) {
  const at::Tensor& like = in[0];
  const int64_t B = like.size(0), T = like.size(1);
  const bool* mp = m.data_ptr<bool>();
  const Weights wt = row_weights(mp, B, T, p);
  std::array<const scalar_t*, kIn> ptr;
  for (size_t k = 0; k < kIn; ++k) ptr[k] = in[k].template data_ptr<scalar_t>();
  at::Tensor grad = with_grad ? at::empty({B, T}, like.options()) : at::Tensor();
  const auto acc = loss_pass<scalar_t, kIn>(ptr, mp, B, T, wt.w.data(), 1.0,
                                            with_grad ? grad.template data_ptr<scalar_t>() : nullptr, chunk);
  Reduced r = finish(acc, wt, like);
  r.grad = grad;
  return r;
}

template <typename scalar_t, size_t kIn, typename Chunk>
at::Tensor run_backward(const at::Tensor& grad, const std::array<at::Tensor, kIn>& in, const at::Tensor& m,
                        const at::Tensor& row_weight, const Chunk& chunk) {
  const at::Tensor& like = in[0];
  const int64_t B = like.size(0), T = like.size(1);
  const double g = grad_scalar(grad);
  std::array<const scalar_t*, kIn> ptr;
  for (size_t k = 0; k < kIn; ++k) ptr[k] = in[k].template data_ptr<scalar_t>();
  at::Tensor out = at::empty({B, T}, like.options());
  loss_pass<scalar_t, kIn>(ptr, m.data_ptr<bool>(), B, T, row_weight.data_ptr<double>(), g,
                           out.template data_ptr<scalar_t>(), chunk);
  return out;
}

// ---- aggregation of a given per-token loss

std::tuple<at::Tensor, at::Tensor> agg_loss_cpu(const at::Tensor& loss, const at::Tensor& mask, c10::string_view mode,
                                                std::optional<double> global_tokens, std::optional<double> global_seqs,
                                                int64_t dp_size, std::optional<double> norm_len) {
  const char* op = "agg_loss";
  check_bt(loss, op, "loss");
  check_mask_of(loss, mask, op, "loss");
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, loss.size(1), op);
  const at::Tensor x = loss.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  Reduced red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, loss.scalar_type(), "verl_agg_loss", [&] {
    using T_ = comp_t<scalar_t>;
    red = run_forward<scalar_t, 1>({x}, m, p, false,
                                   [](int64_t, const std::array<const T_*, 1>& q, const bool* mp, int64_t n, T_,
                                      T_*) { return sum_chunk(q[0], mp, n); });
  });
  return {red.loss, red.row_weight};
}

// d loss / d x = mask ? grad * w_b : 0, written as bit patterns (0 bits = +0.0 in every float type).
at::Tensor agg_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& mask, const at::Tensor& row_weight) {
  const char* op = "agg_loss_backward";
  check_floating(grad, op, "grad");
  TORCH_CHECK(mask.dim() == 2, op, ": `mask` must be 2-D [B, T], got ", mask.sizes());
  const int64_t B = mask.size(0), T = mask.size(1);
  check_row_weight(row_weight, B, op);
  const double g = grad_scalar(grad);
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out = at::empty({B, T}, grad.options());
  const double* w = row_weight.data_ptr<double>();
  const bool* mp = m.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "verl_agg_loss_backward", [&] {
    using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t,
                                      std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>>;
    bits_t* op_ = reinterpret_cast<bits_t*>(out.data_ptr<scalar_t>());
    at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t v = static_cast<scalar_t>(g * w[b]);
        bits_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        select_fill(mp + b * T, T, bits, op_ + b * T);
      }
    });
  });
  return out;
}

// ---- KL loss

template <typename scalar_t>
auto kl_chunk_of(Kl k) {
  using T_ = comp_t<scalar_t>;
  return [k](int64_t, const std::array<const T_*, 2>& q, const bool* mp, int64_t n, T_ w, T_* g) {
    return kl_chunk(k, q[0], q[1], mp, n, w, g);
  };
}

Reduced kl_loss_impl(const at::Tensor& logprob, const at::Tensor& ref_logprob, const at::Tensor& mask,
                     c10::string_view kind, c10::string_view mode, std::optional<double> global_tokens,
                     std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                     bool with_grad, const char* op) {
  const Kl k = check_kl_inputs(logprob, ref_logprob, mask, kind, op);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, logprob.size(1), op);
  const at::Tensor a = logprob.contiguous(), r = ref_logprob.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  Reduced red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_loss", [&] {
    red = run_forward<scalar_t, 2>({a, r}, m, p, with_grad, kl_chunk_of<scalar_t>(k));
  });
  return red;
}

std::tuple<at::Tensor, at::Tensor> kl_loss_cpu(const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                               const at::Tensor& mask, c10::string_view kind, c10::string_view mode,
                                               std::optional<double> global_tokens, std::optional<double> global_seqs,
                                               int64_t dp_size, std::optional<double> norm_len) {
  Reduced red = kl_loss_impl(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size, norm_len,
                             false, "kl_loss");
  return {red.loss, red.row_weight};
}

std::tuple<at::Tensor, at::Tensor> kl_loss_with_grad_cpu(const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                                         const at::Tensor& mask, c10::string_view kind,
                                                         c10::string_view mode, std::optional<double> global_tokens,
                                                         std::optional<double> global_seqs, int64_t dp_size,
                                                         std::optional<double> norm_len) {
  Reduced red = kl_loss_impl(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size, norm_len,
                             true, "kl_loss_with_grad");
  return {red.loss, red.grad};
}

at::Tensor kl_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                const at::Tensor& mask, const at::Tensor& row_weight, c10::string_view kind) {
  const char* op = "kl_loss_backward";
  const Kl k = check_kl_inputs(logprob, ref_logprob, mask, kind, op);
  check_row_weight(row_weight, logprob.size(0), op);
  const at::Tensor a = logprob.contiguous(), r = ref_logprob.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_loss_backward", [&] {
    out = run_backward<scalar_t, 2>(grad, {a, r}, m, row_weight, kl_chunk_of<scalar_t>(k));
  });
  return out;
}

// ---- policy loss

// GSPO's sequence log-ratio: the mean of (logp - old_logp) over the row's valid tokens (0 for other types).
template <typename scalar_t>
std::vector<double> seq_log_ratios(Pg type, const scalar_t* lp, const scalar_t* olp, const bool* mp, int64_t B,
                                   int64_t T) {
  std::vector<double> out(B, 0.0);
  if (type != Pg::Gspo) return out;
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      double s = 0.0, c = 0.0;
      for (int64_t t = b * T; t < (b + 1) * T; ++t) {
        if (!mp[t]) continue;
        s += static_cast<double>(lp[t]) - static_cast<double>(olp[t]);
        c += 1.0;
      }
      out[b] = c > 0.0 ? s / c : 0.0;
    }
  });
  return out;
}

template <typename scalar_t>
auto pg_chunk_of(const PgParams& pg, const std::vector<double>& seq_lr) {
  using T_ = comp_t<scalar_t>;
  return [&pg, &seq_lr](int64_t b, const std::array<const T_*, 3>& q, const bool* mp, int64_t n, T_ w, T_* g) {
    return pg_chunk(pg.type, q[0], q[1], q[2], static_cast<T_>(seq_lr[b]), mp, n, pg, w, g);
  };
}

struct PgIn {
  at::Tensor lp, olp, ad, m;
};

PgIn pg_inputs(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages,
               const at::Tensor& mask, const char* op) {
  check_pg_inputs(logprob, old_logprob, advantages, mask, op);
  return {logprob.contiguous(), old_logprob.contiguous(), advantages.contiguous(), mask_as_bool(mask)};
}

Reduced policy_loss_impl(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages,
                         const at::Tensor& mask, c10::string_view loss_type, double clip_low, double clip_high,
                         double clip_c, c10::string_view mode, std::optional<double> global_tokens,
                         std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                         bool with_grad, const char* op) {
  const PgParams pg = make_pg(loss_type, clip_low, clip_high, clip_c, op);
  const PgIn in = pg_inputs(logprob, old_logprob, advantages, mask, op);
  const int64_t B = logprob.size(0), T = logprob.size(1);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, T, op);
  Reduced red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_policy_loss", [&] {
    const auto seq_lr = seq_log_ratios(pg.type, in.lp.data_ptr<scalar_t>(), in.olp.data_ptr<scalar_t>(),
                                       in.m.data_ptr<bool>(), B, T);
    red = run_forward<scalar_t, 3>({in.lp, in.olp, in.ad}, in.m, p, with_grad, pg_chunk_of<scalar_t>(pg, seq_lr));
  });
  return red;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages, const at::Tensor& mask,
    c10::string_view loss_type, double clip_low, double clip_high, double clip_c, c10::string_view mode,
    std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
    std::optional<double> norm_len) {
  const Reduced r = policy_loss_impl(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c,
                                     mode, global_tokens, global_seqs, dp_size, norm_len, false, "policy_loss");
  return {r.loss, stat_tensor(r.s0, r.tokens, logprob), stat_tensor(r.s1, r.tokens, logprob),
          stat_tensor(r.s2, r.tokens, logprob), r.row_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_with_grad_cpu(
    const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages, const at::Tensor& mask,
    c10::string_view loss_type, double clip_low, double clip_high, double clip_c, c10::string_view mode,
    std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
    std::optional<double> norm_len) {
  const Reduced r = policy_loss_impl(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c,
                                     mode, global_tokens, global_seqs, dp_size, norm_len, true,
                                     "policy_loss_with_grad");
  return {r.loss, stat_tensor(r.s0, r.tokens, logprob), stat_tensor(r.s1, r.tokens, logprob),
          stat_tensor(r.s2, r.tokens, logprob), r.grad};
}

at::Tensor policy_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& old_logprob,
                                    const at::Tensor& advantages, const at::Tensor& mask, const at::Tensor& row_weight,
                                    c10::string_view loss_type, double clip_low, double clip_high, double clip_c) {
  const char* op = "policy_loss_backward";
  const PgParams pg = make_pg(loss_type, clip_low, clip_high, clip_c, op);
  const PgIn in = pg_inputs(logprob, old_logprob, advantages, mask, op);
  const int64_t B = logprob.size(0), T = logprob.size(1);
  check_row_weight(row_weight, B, op);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_policy_loss_backward", [&] {
    const auto seq_lr = seq_log_ratios(pg.type, in.lp.data_ptr<scalar_t>(), in.olp.data_ptr<scalar_t>(),
                                       in.m.data_ptr<bool>(), B, T);
    out = run_backward<scalar_t, 3>(grad, {in.lp, in.olp, in.ad}, in.m, row_weight, pg_chunk_of<scalar_t>(pg, seq_lr));
  });
  return out;
}

// ---- value loss

template <typename scalar_t>
auto vf_chunk_of(double clip) {
  using T_ = comp_t<scalar_t>;
  return [clip](int64_t, const std::array<const T_*, 3>& q, const bool* mp, int64_t n, T_ w, T_* g) {
    return vf_chunk(q[0], q[1], q[2], static_cast<T_>(clip), mp, n, w, g);
  };
}

Reduced value_loss_impl(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                        const at::Tensor& mask, double clip, c10::string_view mode,
                        std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
                        std::optional<double> norm_len, bool with_grad, const char* op) {
  check_vf_inputs(values, old_values, returns, mask, clip, op);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, values.size(1), op);
  const at::Tensor v = values.contiguous(), ov = old_values.contiguous(), rt = returns.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  Reduced red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_value_loss", [&] {
    red = run_forward<scalar_t, 3>({v, ov, rt}, m, p, with_grad, vf_chunk_of<scalar_t>(clip));
  });
  return red;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cpu(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& mask,
    double clip, c10::string_view mode, std::optional<double> global_tokens, std::optional<double> global_seqs,
    int64_t dp_size, std::optional<double> norm_len) {
  const Reduced r = value_loss_impl(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs,
                                    dp_size, norm_len, false, "value_loss");
  return {r.loss, stat_tensor(r.s0, r.tokens, values), r.row_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_with_grad_cpu(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& mask,
    double clip, c10::string_view mode, std::optional<double> global_tokens, std::optional<double> global_seqs,
    int64_t dp_size, std::optional<double> norm_len) {
  const Reduced r = value_loss_impl(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs,
                                    dp_size, norm_len, true, "value_loss_with_grad");
  return {r.loss, stat_tensor(r.s0, r.tokens, values), r.grad};
}

at::Tensor value_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& old_values,
                                   const at::Tensor& returns, const at::Tensor& mask, const at::Tensor& row_weight,
                                   double clip) {
  const char* op = "value_loss_backward";
  check_vf_inputs(values, old_values, returns, mask, clip, op);
  check_row_weight(row_weight, values.size(0), op);
  const at::Tensor v = values.contiguous(), ov = old_values.contiguous(), rt = returns.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_value_loss_backward", [&] {
    out = run_backward<scalar_t, 3>(grad, {v, ov, rt}, m, row_weight, vf_chunk_of<scalar_t>(clip));
  });
  return out;
}

}  // namespace

// The backward of every *_with_grad op: the saved d loss / d x times the incoming scalar gradient. One
// device-generic kernel (ATen's vectorised multiply) serves CPU and CUDA.
at::Tensor loss_grad_scale(const at::Tensor& grad, const at::Tensor& saved_grad) {
  TORCH_CHECK(grad.numel() == 1, "loss_grad_scale: `grad` must be the gradient of the scalar loss, got shape ",
              grad.sizes());
  return at::mul(saved_grad, grad.reshape({}).to(saved_grad.scalar_type()));
}

TORCH_LIBRARY_IMPL(verl, CompositeExplicitAutograd, m) { m.impl("loss_grad_scale", &loss_grad_scale); }

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("gae", &gae_cpu);
  m.impl("gae_whitened", &gae_whitened_cpu);
  m.impl("outcome_advantage", &outcome_advantage_cpu);
  m.impl("kl_penalty", &kl_penalty_cpu);
  m.impl("kl_penalty_backward", &kl_penalty_backward_cpu);
  m.impl("agg_loss", &agg_loss_cpu);
  m.impl("agg_loss_backward", &agg_loss_backward_cpu);
  m.impl("kl_loss", &kl_loss_cpu);
  m.impl("kl_loss_with_grad", &kl_loss_with_grad_cpu);
  m.impl("kl_loss_backward", &kl_loss_backward_cpu);
  m.impl("policy_loss", &policy_loss_cpu);
  m.impl("policy_loss_with_grad", &policy_loss_with_grad_cpu);
  m.impl("policy_loss_backward", &policy_loss_backward_cpu);
  m.impl("value_loss", &value_loss_cpu);
  m.impl("value_loss_with_grad", &value_loss_with_grad_cpu);
  m.impl("value_loss_backward", &value_loss_backward_cpu);
}

}  // namespace verl

// ------------------------------------------------------------------------------------------ agg_loss autograd (C++)
//
// agg_loss (e.g. the entropy bonus) is so cheap that the Python autograd wrapper of torch.library (~60 us of
// fixed cost per forward + backward) dominated it at training sizes; its autograd kernel is C++ instead. Same
// contract as the Python registrations of the other loss ops: saves (mask, row_weight), backward is
// agg_loss_backward. Registered for the Autograd key, so it serves every device.
#include <torch/autograd.h>

namespace verl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AggLossFunction : public torch::autograd::Function<AggLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& loss, const at::Tensor& mask,
                               const std::string& mode, std::optional<double> global_tokens,
                               std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("verl::agg_loss", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(
                             const at::Tensor&, const at::Tensor&, c10::string_view, std::optional<double>,
                             std::optional<double>, int64_t, std::optional<double>)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rw] = op.call(loss, mask, mode, global_tokens, global_seqs, dp_size, norm_len);
    ctx->save_for_backward({mask, rw});
    ctx->mark_non_differentiable({rw});
    return {out, rw};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("verl::agg_loss_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor g = grads[0].defined() ? op.call(grads[0], saved[0], saved[1]) : at::Tensor();
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> agg_loss_autograd(const at::Tensor& loss, const at::Tensor& mask,
                                                     c10::string_view mode, std::optional<double> global_tokens,
                                                     std::optional<double> global_seqs, int64_t dp_size,
                                                     std::optional<double> norm_len) {
  variable_list out = AggLossFunction::apply(loss, mask, std::string(mode), global_tokens, global_seqs, dp_size,
                                             norm_len);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, Autograd, m) { m.impl("agg_loss", &agg_loss_autograd); }

}  // namespace verl
