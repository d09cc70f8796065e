// CPU kernel of one decode step's attention (contract in csrc/include/verl/attention.h).
//
// A decode step has one query per row and head against the whole key/value cache, so it reads the cache once
// and does a few multiply-adds per cached float: its speed is the speed at which the cache streams from memory.
// SDPA's CPU kernel treats it as a tiny flash-attention problem (blocks, a float mask per block, rescaling) and
// ran SmolLM2's 32-row step at ~6 GB/s of cache on an AMD EPYC whose one core reads 16.5 GB/s. Here each
// (row, key/value head) is one task: each of the G query heads that share the key/value head scores the cached
// keys 8 at a time (the head's keys, ~46 KB at 180 positions, stay in L2 for the other G - 1), a softmax per
// query in place, then each value row is loaded once per 32 floats of head_dim and added into all G outputs.
// Masked positions change nothing whatever their cache columns hold (NaN included): their scores are replaced
// by -inf and their value rows are skipped.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "verl/attention.h"
#include "verl/cpu_math.h"

namespace verl {
namespace {

struct Head {
  const float* q;     // [G, d] contiguous
  const float* k;     // row t at k + t * kts, d contiguous floats
  const float* v;
  const bool* mask;   // [T]
  float* out;         // [G, d] contiguous
  int64_t G, d, T, kts, vts;
  float scale;
};

// An unaligned, aliasing view of 8 floats: loads into arrays of vf8 through load_vf8's memcpy compiled to
// 16-byte copies through the stack here (a store-forwarding stall per load in the value loop).
typedef float vf8u __attribute__((vector_size(32), aligned(4), may_alias));
#define VERL_LD8(p) (*reinterpret_cast<const vf8u*>(p))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// out[i] = sum of r[i]'s lanes for 8 vectors: three rounds of pairwise shuffles and adds instead of eight
// horizontal sums.
static inline __attribute__((always_inline)) void sum8(vf8* r, vf8& out) {
  vf8 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // b[0] = (r0, r1, r2, r3 over lanes 0-3 | the same over lanes 4-7), b[1] the same for r4..r7
  out = __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
        __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// The dot products of one query (d floats, a multiple of 8) with 8 consecutive key rows: 8 independent
// accumulators, reduced together by sum8.
static inline __attribute__((always_inline)) void score8(const float* q, const float* k, int64_t kts, int64_t d,
                                                         float* s) {
  vf8 acc[8] = {}, qv, out;
  for (int64_t c = 0; c < d; c += 8) {
    load_vf8(qv, q + c);
    for (int i = 0; i < 8; ++i) acc[i] += qv * VERL_LD8(k + i * kts + c);
  }
  sum8(acc, out);
  store_vf8(s, out);
}

static inline __attribute__((always_inline)) float score1(const float* q, const float* k, int64_t d) {
  vf8 acc = {}, qv;
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) load_vf8(qv, q + c), acc += qv * VERL_LD8(k + c);
  float dot = hsum(acc);
  for (; c < d; ++c) dot += q[c] * k[c];
  return dot;
}

// out[g0 .. g0 + NB) = inv * sum over valid t of p[g, t] * v[t]: NB x 4 vector accumulators (12 of AVX2's 16
// registers at NB = 3) per 32 floats of d.
template <int NB>
static inline __attribute__((always_inline)) void accumulate(const Head& h, const float* s, const float* inv,
                                                             int64_t g0) {
  const int64_t d = h.d, T = h.T;
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    vf8 acc[NB][4] = {}, vv[4];
    for (int64_t t = 0; t < T; ++t) {
      if (!h.mask[t]) continue;
      const float* vr = h.v + t * h.vts + c;
      for (int i = 0; i < 4; ++i) vv[i] = VERL_LD8(vr + 8 * i);
      for (int j = 0; j < NB; ++j) {
        const float p = s[(g0 + j) * T + t];
        for (int i = 0; i < 4; ++i) acc[j][i] += p * vv[i];
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < 4; ++i) {
        const vf8 o = acc[j][i] * inv[g0 + j];
        store_vf8(h.out + (g0 + j) * d + c + 8 * i, o);
      }
  }
  for (; c < d; ++c)
    for (int j = 0; j < NB; ++j) {
      const float* sg = s + (g0 + j) * T;
      float o = 0.f;
      for (int64_t t = 0; t < T; ++t)
        if (h.mask[t]) o += sg[t] * h.v[t * h.vts + c];
      h.out[(g0 + j) * d + c] = o * inv[g0 + j];
    }
}

// The first pass over the keys asks for the key rows 16 ahead (the cache streams from memory: it is much larger
// than the caches). With it the kernel read SmolLM2's cache at ~10 GB/s, without ~8.5 GB/s, on one core of an
// AMD EPYC that sums a contiguous array at ~16 GB/s; asking for the value rows as well was slower.
static inline __attribute__((always_inline)) void prefetch8(const Head& h, int64_t t) {
  const int64_t ahead = std::min<int64_t>(t + 16, h.T - 8);
  for (int i = 0; i < 8; ++i)
    for (int64_t c = 0; c < h.d; c += 16) __builtin_prefetch(h.k + (ahead + i) * h.kts + c);
}

// One (row, key/value head): scores s [G, T] (-inf at masked positions), softmax in place, then the outputs.
VERL_SIMD_CLONES void attend(const Head& h, float* s) {
  const int64_t G = h.G, d = h.d, T = h.T;
  const int64_t T8 = (d % 8 == 0) ? (T & ~int64_t(7)) : 0;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = h.q + g * d;
    float* sg = s + g * T;
    // 8 keys at a time; a masked key's lane is overwritten (its cache row may hold anything, NaN included, and
    // each lane of score8 is one key's sum alone)
    int64_t t = 0;
    for (; t < T8; t += 8) {
      if (g == 0) prefetch8(h, t);
      score8(qg, h.k + t * h.kts, h.kts, d, sg + t);
      for (int i = 0; i < 8; ++i) sg[t + i] = h.mask[t + i] ? sg[t + i] : kNegInf;
    }
    for (; t < T; ++t) sg[t] = h.mask[t] ? score1(qg, h.k + t * h.kts, d) : kNegInf;
  }
  // softmax per query, in place: exp((s - max) * scale), 0 at masked positions
  std::vector<float> inv(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * T;
    vf8 mv, x, e, acc = {};
    float mx = kNegInf;
    int64_t t = 0;
    if (T >= 8) {
      load_vf8(mv, sg);
      for (t = 8; t + 8 <= T; t += 8) load_vf8(x, sg + t), mv = x > mv ? x : mv;
      mx = hmax(mv);
    }
    for (; t < T; ++t) mx = sg[t] > mx ? sg[t] : mx;
    if (mx == kNegInf) {  // no valid position: zeros
      inv[g] = 0.f;
      std::fill(sg, sg + T, 0.f);
      continue;
    }
    for (t = 0; t + 8 <= T; t += 8) {
      load_vf8(x, sg + t);
      e = (x - mx) * h.scale;
      e = e > -87.0f ? e : -87.0f;
      exp_poly_inplace(e);
      e = x == kNegInf ? 0.0f : e;
      acc += e;
      store_vf8(sg + t, e);
    }
    float sum = hsum(acc);
    for (; t < T; ++t) {
      const float v = sg[t] == kNegInf ? 0.f : exp_poly(std::max((sg[t] - mx) * h.scale, -87.0f));
      sg[t] = v;
      sum += v;
    }
    inv[g] = 1.f / sum;
  }
  // outputs: NB queries x 32 floats of d at a time in registers; each value row is loaded once per 32 floats
  int64_t g0 = 0;
  for (; g0 + 3 <= G; g0 += 3) accumulate<3>(h, s, inv.data(), g0);
  switch (G - g0) {
    case 2: accumulate<2>(h, s, inv.data(), g0); break;
    case 1: accumulate<1>(h, s, inv.data(), g0); break;
    default: break;
  }
}

at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask_in, double scale) {
  check_decode_attention(q_in, k, v, mask_in);
  const at::Tensor q = q_in.contiguous(), mask = mask_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), d = q.size(3), T = k.size(2);
  at::Tensor out = at::empty_like(q);
  if (q.numel() == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> s(static_cast<size_t>(G * std::max<int64_t>(T, 1)));
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t b = i / H, hh = i % H;
      Head h{qp + i * G * d, kp + b * k.stride(0) + hh * k.stride(1), vp + b * v.stride(0) + hh * v.stride(1),
             mp + b * T, op + i * G * d, G, d, T, k.stride(2), v.stride(2), sc};
      if (i + 1 < b1) {  // the next head's first key and value rows, while this one computes
        const int64_t nb = (i + 1) / H, nh = (i + 1) % H;
        const float* nk = kp + nb * k.stride(0) + nh * k.stride(1);
        const float* nv = vp + nb * v.stride(0) + nh * v.stride(1);
        for (int64_t t = 0; t < std::min<int64_t>(T, 16); ++t)
          for (int64_t c = 0; c < d; c += 16) {
            __builtin_prefetch(nk + t * k.stride(2) + c);
            __builtin_prefetch(nv + t * v.stride(2) + c);
          }
      }
      attend(h, s.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace verl
