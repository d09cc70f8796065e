// CPU kernels of the advantage ops (the policy of verl/rl_advantage.h's drivers): GAE, optionally whitened, and
// outcome (group) advantages. Row sums are accumulated in double.
//
// FP operations here never rely on floating-point exception flags; telling GCC so (-fno-trapping-math for
// this file only) is what lets it turn the per-token selects into SIMD blends.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "verl/rl_advantage.h"
#include "verl/rl_cpu.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#endif

namespace verl {
namespace {

using namespace verl::rl;

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

// The 8 lanes' running GAE state (one row each) between blocks of 8 timesteps.
struct Lanes8 {
  __m256 nv, run;
  __m256i nbad, cnt;
  __m256d s_lo, s_hi, q_lo, q_hi;
};

// The first T % 8 timesteps of each of the 8 rows, in the scalar scan continuing each lane's state, then each
// row's statistics.
template <typename S>
VERL_AVX2 void finish_group8(const Lanes8& L, const S* rp, const S* vp, const bool* mp, int64_t T, float gamma, float gl,
                   S* ap, S* tp, ScanStats* out) {
  alignas(32) float nvl[8], runl[8];
  alignas(32) int32_t badl[8], cntl[8];
  alignas(32) double sl[8], ql[8];
  _mm256_store_ps(nvl, L.nv);
  _mm256_store_ps(runl, L.run);
  _mm256_store_si256(reinterpret_cast<__m256i*>(badl), L.nbad);
  _mm256_store_si256(reinterpret_cast<__m256i*>(cntl), L.cnt);
  _mm256_store_pd(sl, L.s_lo);
  _mm256_store_pd(sl + 4, L.s_hi);
  _mm256_store_pd(ql, L.q_lo);
  _mm256_store_pd(ql + 4, L.q_hi);
  const int64_t head = T % 8;
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

// Rows [0, 8) starting at rp / vp / mp / ap / tp (row stride T). Blocks of 8 timesteps from the end; the first
// T % 8 timesteps of each row finish in the scalar scan, continuing each lane's state (finish_group8).
template <typename S>
VERL_AVX2 void gae_group8(const S* rp, const S* vp, const bool* mp, int64_t T, float gamma, float gl, S* ap, S* tp,
                          ScanStats* out) {
  const __m256 G = _mm256_set1_ps(gamma), GL = _mm256_set1_ps(gl), zero = _mm256_setzero_ps();
  Lanes8 L{zero, zero, _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_pd(), _mm256_setzero_pd(),
           _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int64_t tb = T - 8; tb >= T % 8; tb -= 8) {
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
      const __m256 nw = _mm256_fmadd_ps(GL, L.run, _mm256_sub_ps(_mm256_fmadd_ps(G, L.nv, R[j]), V[j]));
      L.run = _mm256_blendv_ps(L.run, nw, keep);
      L.nv = _mm256_blendv_ps(L.nv, V[j], keep);
      const __m256 fin = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(R[j], R[j]), zero, _CMP_EQ_OQ),
                                       _mm256_cmp_ps(_mm256_sub_ps(V[j], V[j]), zero, _CMP_EQ_OQ));
      L.nbad = _mm256_sub_epi32(L.nbad, _mm256_castps_si256(_mm256_andnot_ps(fin, keep)));
      L.cnt = _mm256_sub_epi32(L.cnt, _mm256_castps_si256(keep));
      const __m256 a = _mm256_and_ps(nw, keep);
      R[j] = a;  // R and V now hold the outputs of step j
      V[j] = _mm256_and_ps(_mm256_add_ps(nw, V[j]), keep);
      // Sums in double per step: float partial sums lose the variance of advantages with a large common offset.
      const __m256 st = as_stored<S>(a);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(st)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(st, 1));
      L.s_lo = _mm256_add_pd(L.s_lo, lo);
      L.s_hi = _mm256_add_pd(L.s_hi, hi);
      L.q_lo = _mm256_fmadd_pd(lo, lo, L.q_lo);
      L.q_hi = _mm256_fmadd_pd(hi, hi, L.q_hi);
    }
    transpose8(R);
    transpose8(V);
    for (int r = 0; r < 8; ++r) {
      store8(ap + r * T + tb, R[r]);
      store8(tp + r * T + tb, V[r]);
    }
  }
  finish_group8<S>(L, rp, vp, mp, T, gamma, gl, ap, tp, out);
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

// Scans every row: groups of 8 rows where the CPU has AVX2+FMA, one row at a time for the rest.
template <typename scalar_t>
std::vector<ScanStats> gae_scan(const GaeArgs& a) {
  const int64_t B = a.r.size(0), T = a.r.size(1);
  const scalar_t* rp = a.r.data_ptr<scalar_t>();
  const scalar_t* vp = a.v.defined() ? a.v.data_ptr<scalar_t>() : nullptr;
  const bool* mp = a.m.data_ptr<bool>();
  scalar_t* ap = a.adv.data_ptr<scalar_t>();
  scalar_t* tp = a.ret.data_ptr<scalar_t>();
  std::vector<ScanStats> rows(B);
  int64_t done = 0;
#if VERL_HAVE_GAE8
  done = gae_rows8(rp, vp, mp, B, T, a.gamma, a.lam, ap, tp, rows);
#endif
  at::parallel_for(done, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t off = b * T;
      rows[b] = gae_row(rp + off, vp ? vp + off : nullptr, mp + off, T, a.gamma, a.lam, ap + off, tp + off);
    }
  });
  return rows;
}

// Calls f(b, chunk, base, len) over every row of x [B, T] in kChunk pieces (base: the chunk's flat offset), with
// the chunk in the compute type: float32 / float64 in place, 16-bit types through an L1 buffer, written back
// when kWrite.
template <bool kWrite, typename S, typename F>
void for_row_chunks(S* x, int64_t B, int64_t T, const F& f) {
  using scalar_t = std::remove_const_t<S>;
  using T_ = comp_t<scalar_t>;
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    T_ buf[std::is_same_v<scalar_t, T_> ? 1 : kChunk];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t len = std::min<int64_t>(kChunk, T - t0), base = b * T + t0;
        if constexpr (std::is_same_v<scalar_t, T_>) {
          f(b, x + base, base, len);
        } else {
          load_chunk(x + base, buf, len);
          f(b, buf, base, len);
          if constexpr (kWrite) store_chunk(buf, x + base, len);
        }
      }
    }
  });
}

// a = m ? (a - mean) * rstd : 0 in place over [B, T].
template <typename scalar_t>
void whiten_rows(scalar_t* ap, const bool* mp, int64_t B, int64_t T, double mean, double rstd) {
  using T_ = comp_t<scalar_t>;
  const T_ mu = static_cast<T_>(mean), rs = static_cast<T_>(rstd);
  for_row_chunks<true>(ap, B, T, [&](int64_t, T_* a, int64_t base, int64_t len) {
    whiten_chunk(a, mp + base, len, mu, rs);
  });
}

// The whitening statistics (masked_whiten: mean 0, unbiased variance, eps inside the square root) of all valid
// advantages, merged from the rows' (n, mean, M2) with Chan et al.'s formula: (mean, 1 / std).
std::pair<double, double> whiten_stats(const std::vector<ScanStats>& rows, double eps) {
  double n = 0.0, mean = 0.0, m2 = 0.0;
  for (const ScanStats& s : rows) {
    if (s.n == 0.0) continue;
    const double tot = n + s.n, d = s.mean - mean;
    mean += d * s.n / tot;
    m2 += s.m2 + d * d * n * s.n / tot;
    n = tot;
  }
  const double var = n > 1.0 ? m2 / (n - 1.0) : 0.0;
  return {mean, 1.0 / std::sqrt(var + eps)};
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
  for_row_chunks<false>(rp, B, T, [&](int64_t b, const T_* r, int64_t base, int64_t len) {
    masked_sum_nonfinite(r, mp + base, len, &score[b], &bad[b]);
  });
}

struct CpuAdvantage {
  using Guard = NoGuard;

  template <typename scalar_t>
  static void gae(const GaeArgs& a) {
    const std::vector<ScanStats> rows = gae_scan<scalar_t>(a);
    if (a.whiten_eps) {  // the statistics come out of the scan: whitening is one more in-place pass
      const auto [mean, rstd] = whiten_stats(rows, *a.whiten_eps);
      whiten_rows(a.adv.data_ptr<scalar_t>(), a.m.data_ptr<bool>(), a.r.size(0), a.r.size(1), mean, rstd);
    }
    int64_t bad = 0;
    for (const ScanStats& s : rows) bad += s.bad;
    *a.bad.data_ptr<int64_t>() = bad;
  }

  template <typename scalar_t>
  static void outcome(const OutcomeArgs& a) {
    const int64_t B = a.r.size(0), T = a.r.size(1);
    const bool* mp = a.m.data_ptr<bool>();
    std::vector<double> score(B, 0.0);
    std::vector<int64_t> bad(B, 0);
    row_scores(a.r.data_ptr<scalar_t>(), mp, B, T, score, bad);
    if (a.base.defined()) {
      const double* bp = a.base.data_ptr<double>();
      for (int64_t b = 0; b < B; ++b) {
        bad[b] += std::isfinite(bp[b]) ? 0 : 1;
        score[b] -= bp[b];
      }
    }
    int64_t G = 0;
    const std::vector<int64_t> gid = dense_groups(a.index, G);
    const std::vector<double> adv_b = outcome_scores_to_adv(score, gid, G, a.est, a.eps, a.norm_by_std);
    fill_rows(mp, B, T, a.adv.data_ptr<scalar_t>(), [&](int64_t b) { return adv_b[b]; });
    int64_t total_bad = 0;
    for (int64_t x : bad) total_bad += x;
    *a.bad.data_ptr<int64_t>() = total_bad;
  }
};

using K = CpuAdvantage;

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) { rl::register_advantage_ops<K>(m); }

}  // namespace verl
