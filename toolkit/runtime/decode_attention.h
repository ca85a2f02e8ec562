// Decode attention over the paged K/V pool, read in place: shared by rtk's two kernel libraries, the float32
// engines' (kernels_avx2.cpp, a float32 pool) and the bf16 engines' (kernels.cpp, a bf16 pool, each element
// widened exactly to float32 as it is read).  kernels.build_dir hashes this header with each source that
// includes it.
//
// Each decode row (one query per sequence) attends to its own context, whose keys and values are read
// where they lie in the pool, at their slots: no gathered copy of the context per layer and step (which,
// with SDPA's fixed cost per call, was most of attention's time: ~37 us a call at 66 keys, ~130 us at
// 400, 30 calls a SmolLM2 step).  For each K/V head, its query heads' scores q . k * scale, then the
// softmax (max subtracted, exp_nonpositive, sum) and the probabilities' sum of the values divided by
// their sum; float32 throughout, in one fixed order for a row, so a row's numbers depend on that row
// alone, whatever else the step holds.  Not SDPA's order (blocks of keys, online softmax, MKL's dot
// products): within float32 rounding of it (tests/test_runtime_kernels_avx2.py).  A bf16 pool's values
// are exactly a float32 pool's after the widening, so both pools give the same numbers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace rtk_attention {

// e^x for x <= 0, 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial,
// 2^n in the exponent bits), within 2 ulp of the float32 result; below -87 it gives e^-87 (~1.6e-38,
// still a normal float), not 0, which the softmax's sum cannot tell from 0 next to its largest term, 1.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// the sum of a's 8 lanes: halves, then pairs (kernels_avx2's hsum too)
inline float lane_sum(__m256 a) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// The 8 sums of a[0..7]'s lanes, in lane order: a fixed tree of pairwise adds.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // each 128-bit half: 4 partial sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 pool elements from p as float32: a float32 pool's as they are, a bf16 pool's (uint16_t bits) widened
// exactly (the bits moved to the top half of a float32)
template <class T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    static_assert(std::is_same_v<T, uint16_t>, "rtk_attention: a float32 or bf16 pool");
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

template <class T>
inline void prefetch_row(const T* p, int64_t n) {
  const auto* b = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(b + i, _MM_HINT_T0);
}

// dst[0 : 8N] = sum_j p[j] * v_j[0 : 8N] / total, v_j = v + ctx[j] * row: even and odd keys in two sets of
// N accumulators (the FMA's latency, not its throughput, bounds one set), added once at the end.
template <int N, class T>
inline void weigh_values(const float* p, int64_t L, const T* v, int64_t row, const int64_t* ctx, float total,
                         float* dst) {
  __m256 a[N], b[N];
  for (int i = 0; i < N; ++i) a[i] = b[i] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= L; j += 2) {
    if (j + 8 < L) {
      prefetch_row(v + ctx[j + 8] * row, 8 * N);
      prefetch_row(v + ctx[j + 9 < L ? j + 9 : j + 8] * row, 8 * N);
    }
    const T* v0 = v + ctx[j] * row;
    const T* v1 = v + ctx[j + 1] * row;
    const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
    for (int i = 0; i < N; ++i) {
      a[i] = _mm256_fmadd_ps(p0, load8(v0 + 8 * i), a[i]);
      b[i] = _mm256_fmadd_ps(p1, load8(v1 + 8 * i), b[i]);
    }
  }
  if (j < L) {
    const T* v0 = v + ctx[j] * row;
    const __m256 p0 = _mm256_set1_ps(p[j]);
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(p0, load8(v0 + 8 * i), a[i]);
  }
  const __m256 t = _mm256_set1_ps(total);
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(dst + 8 * i, _mm256_div_ps(_mm256_add_ps(a[i], b[i]), t));
}

// Rows r < m: q at q + r * q_row + h * q_head ([H, D] each, D contiguous, float32); the pool [slots, KVH, D]
// of T (float, or uint16_t for bf16 bits); row r's keys are slots[bounds[2r] .. bounds[2r + 1]); out [m, H * D]
// float32.  Threads share the (row, K/V head) pairs: each pair's query heads read that head's slice of the
// keys' and values' rows, in the same order whatever the split, so the numbers do not depend on it.
template <class T>
void decode_attention_rows(const float* q, int64_t q_row, int64_t q_head, const T* kp, const T* vp,
                           const int64_t* slots, const int64_t* bounds, int64_t m, int64_t H, int64_t KVH,
                           int64_t D, float scale, float* out) {
  const int64_t G = H / KVH, row = KVH * D;
  int64_t keys = 0;
  for (int64_t r = 0; r < m; ++r) keys += bounds[2 * r + 1] - bounds[2 * r];
  // threads where there is enough to share: with the pool's workers spinning between calls, a few microseconds
  // of work a thread pays (SmolLM2's 3 rows of ~100 keys: ~50 us, once on one thread while the other waited)
  const int64_t units = m * KVH, grain = keys * H * D < (1 << 14) ? units : 1;
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> sc, total(G);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / KVH, kvh = u % KVH, off = kvh * D;  // the K/V head's slice of a pool row
      const int64_t* ctx = slots + bounds[2 * r];
      const int64_t L = bounds[2 * r + 1] - bounds[2 * r], Lp = (L + 7) / 8 * 8;
      sc.assign(G * Lp, 0.0f);
      const float* qr = q + r * q_row;
      for (int64_t j0 = 0; j0 < L; j0 += 8) {  // scores of 8 keys at a time, each key's slice read once
        const T* k[8];
        for (int64_t i = 0; i < 8; ++i) k[i] = kp + ctx[j0 + i < L ? j0 + i : j0] * row + off;  // past L: any key
        for (int64_t i = 0; i < 8 && j0 + 8 + i < L; ++i) prefetch_row(kp + ctx[j0 + 8 + i] * row + off, D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qr + (kvh * G + g) * q_head;
          __m256 a[8];
          for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(k[i] + d), a[i]);
          }
          _mm256_storeu_ps(sc.data() + g * Lp + j0, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax numerators in place, and their sum
        float* s = sc.data() + g * Lp;
        float mx = s[0];
        for (int64_t j = 1; j < L; ++j) mx = std::max(mx, s[j]);
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < Lp; j += 8) {
          __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
          if (j + 8 > L) {  // the lanes past the context weigh nothing
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, p);
            for (int64_t i = L - j; i < 8; ++i) lanes[i] = 0.0f;
            p = _mm256_load_ps(lanes);
          }
          _mm256_storeu_ps(s + j, p);
          sum = _mm256_add_ps(sum, p);
        }
        total[g] = lane_sum(sum);
      }
      for (int64_t g = 0; g < G; ++g) {  // the values' weighted sums, a head's slice of 32 at a time
        const float* s = sc.data() + g * Lp;
        const T* v = vp + off;
        float* dst = out + r * H * D + (kvh * G + g) * D;
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) weigh_values<4>(s, L, v + d, row, ctx, total[g], dst + d);
        switch ((D - d) / 8) {
          case 3: weigh_values<3>(s, L, v + d, row, ctx, total[g], dst + d); break;
          case 2: weigh_values<2>(s, L, v + d, row, ctx, total[g], dst + d); break;
          case 1: weigh_values<1>(s, L, v + d, row, ctx, total[g], dst + d); break;
          default: break;
        }
      }
    }
  });
}

// The op: q [m, H, D] float32 (D contiguous); k_pool, v_pool [slots, KVH, D] float32 or bf16, contiguous;
// ctx_slots [n] int64; ctx_bounds [m, 2] int64, row r's keys ctx_slots[bounds[r, 0] : bounds[r, 1]].
// -> [m, H * D] float32.  ``who`` names the op in messages.
inline at::Tensor decode_attention(const char* who, const at::Tensor& q, const at::Tensor& k_pool,
                                   const at::Tensor& v_pool, const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds,
                                   double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, who,
              ": q must be [rows, heads, head_dim] float32 with head_dim contiguous");
  const int64_t m = q.size(0), H = q.size(1), D = q.size(2);
  const auto dtype = k_pool.scalar_type();
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  v_pool.scalar_type() == dtype && k_pool.size(2) == D,
              who, ": K/V pools must be [slots, kv_heads, head_dim] float32 or bf16, contiguous, head_dim as q's");
  const int64_t KVH = k_pool.size(1);
  TORCH_CHECK(D % 8 == 0 && KVH > 0 && H % KVH == 0, who, ": head_dim a multiple of 8, heads of kv_heads");
  const at::Tensor cs = ctx_slots.contiguous(), cb = ctx_bounds.contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kLong && cb.scalar_type() == at::kLong && cb.dim() == 2 &&
                  cb.size(0) == m && cb.size(1) == 2,
              who, ": int64 ctx_slots and ctx_bounds [rows, 2]");
  const auto* sp = cs.data_ptr<int64_t>();
  const auto* bp = cb.data_ptr<int64_t>();
  const int64_t n = cs.numel(), slots = k_pool.size(0);
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(0 <= bp[2 * r] && bp[2 * r] < bp[2 * r + 1] && bp[2 * r + 1] <= n, who,
                ": a context bound is out of range");
    for (int64_t j = bp[2 * r]; j < bp[2 * r + 1]; ++j)
      TORCH_CHECK(sp[j] >= 0 && sp[j] < slots, who, ": context slot out of range");
  }
  at::Tensor out = at::empty({m, H * D}, q.options());
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat)
    decode_attention_rows(q.data_ptr<float>(), q.stride(0), q.stride(1), k_pool.data_ptr<float>(),
                          v_pool.data_ptr<float>(), sp, bp, m, H, KVH, D, s, out.data_ptr<float>());
  else
    decode_attention_rows(q.data_ptr<float>(), q.stride(0), q.stride(1),
                          reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                          reinterpret_cast<const uint16_t*>(v_pool.data_ptr()), sp, bp, m, H, KVH, D, s,
                          out.data_ptr<float>());
  return out;
}

}  // namespace rtk_attention
