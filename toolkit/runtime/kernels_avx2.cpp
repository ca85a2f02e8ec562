// rtk's decode GEMV for CPUs without native bf16 dot products (AVX2 + FMA: Zen 1-3, Haswell to Ice
// Lake client parts), where the engine computes in float32 (model.resolve_dtype).  There the dense
// path reads float32 weights: 4 bytes a weight, twice bf16's.  This kernel reads the weights as they
// were stored (bf16 of a bf16 checkpoint, or the FP8 / INT8 / INT4 codes of a quantized export) and
// makes every weight back into exactly the float32 the dense path holds:
//
//   bf16   w = bits << 16                                  (a bf16 value is exact in float32)
//   int8   w = float(code) * scale[o, k / group]           (checkpoint.WeightCodes: one rounding)
//   fp8    w = view(code) * (scale[o, k / group] * 2^120)  (the e4m3 bits shifted into a float32's
//          places are 2^-120 of its value, subnormals included: the product is the same single rounding)
//
// then sums w * x in float32 with fused multiply-adds, 16 inputs a step in two 8-lane accumulators,
// in one fixed order.  The order differs from MKL's sgemv, so the sums differ from the dense path in
// the last bits (checked at load against the float64 product: kernels_avx2.Fp32Weight.within); each
// row is computed the same whether it is alone in a call or with others, so a sequence's numbers
// never depend on the batch.  Threads: torch's intra-op pool (at::parallel_for) over outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBf16 = 0, kInt8 = 1, kFp8 = 2;
constexpr int64_t kRowBlock = 4;  // rows sharing one decode of a weight chunk

template <int64_t Kind>
inline __m256 decode8(const uint8_t* w, int64_t k) {
  if constexpr (Kind == kBf16) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  } else if constexpr (Kind == kInt8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {  // e4m3 sign-extended: bits 31..7 the sign, 6..0 exponent and mantissa; into float32's places
    __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(0x87F00000u)));
  }
}

inline float hsum(__m256 a, __m256 b) {
  __m256 s = _mm256_add_ps(a, b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// out[r] = sum_k x[r, k] * w[k] for rows r < R (R <= kRowBlock) of one output's weights.
template <int64_t Kind>
inline __m256 weights8(const uint8_t* w, __m256 scale, int64_t k) {
  __m256 v = decode8<Kind>(w, k);
  if constexpr (Kind != kBf16) v = _mm256_mul_ps(v, scale);
  return v;
}

// out[r * out_stride] = sum_k x[r, k] * w[k] for rows r < R (R <= kRowBlock) of one output's weights:
// group by group, inputs 16 at a time into two accumulators (a group's last 8 into the first), then
// one fixed horizontal sum.
template <int64_t Kind, int64_t R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* w, const float* scales, int64_t group, float* out,
                     int64_t out_stride) {
  __m256 acc0[R], acc1[R];
  for (int64_t r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const __m256 scale = _mm256_set1_ps(Kind == kBf16 ? 1.0f : scales[g0 / group]);
    const int64_t g1 = g0 + group;
    int64_t k = g0;
    for (; k + 16 <= g1; k += 16) {
      const __m256 w0 = weights8<Kind>(w, scale, k), w1 = weights8<Kind>(w, scale, k + 8);
      for (int64_t r = 0; r < R; ++r) {
        acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc1[r]);
      }
    }
    if (k < g1) {
      const __m256 w0 = weights8<Kind>(w, scale, k);
      for (int64_t r = 0; r < R; ++r) acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc0[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) out[r * out_stride] = hsum(acc0[r], acc1[r]);
}

template <int64_t Kind>
void gemv_kind(const float* x, int64_t rows, int64_t K, const uint8_t* w, int64_t w_row_bytes, const float* scales,
               int64_t groups, int64_t group, int64_t n, float* y) {
  at::parallel_for(0, n, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      const uint8_t* wo = w + o * w_row_bytes;
      const float* so = scales == nullptr ? nullptr : scales + o * groups;
      int64_t r = 0;
      for (; r + kRowBlock <= rows; r += kRowBlock) dot_rows<Kind, kRowBlock>(x + r * K, K, wo, so, group, y + r * n + o, n);
      switch (rows - r) {
        case 3: dot_rows<Kind, 3>(x + r * K, K, wo, so, group, y + r * n + o, n); break;
        case 2: dot_rows<Kind, 2>(x + r * K, K, wo, so, group, y + r * n + o, n); break;
        case 1: dot_rows<Kind, 1>(x + r * K, K, wo, so, group, y + r * n + o, n); break;
        default: break;
      }
    }
  });
}

// x [R, K] float32; weights [N, K] (kind: 0 bf16 bits int16, 1 int8 codes, 2 e4m3 bits uint8);
// scales [N, G] float32 (int8, fp8; fp8's already times 2^120) or None (bf16).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weights, int64_t kind, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.gemv: x must be [rows, K] float32");
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous(), "rtk_avx2.gemv: weights must be [N, K] contiguous");
  const int64_t rows = x.size(0), K = x.size(1), n = weights.size(0);
  TORCH_CHECK(weights.size(1) == K && K % 8 == 0, "rtk_avx2.gemv: K must match the weights and be a multiple of 8");
  TORCH_CHECK(kind == kBf16 || kind == kInt8 || kind == kFp8, "rtk_avx2.gemv: unknown kind ", kind);
  TORCH_CHECK(weights.element_size() == (kind == kBf16 ? 2 : 1), "rtk_avx2.gemv: weights of the wrong width");
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* sp = nullptr;
  int64_t groups = 1, group = K;
  at::Tensor sc;
  if (kind != kBf16) {
    TORCH_CHECK(scales.has_value(), "rtk_avx2.gemv: codes need their scales");
    sc = scales->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 2 && sc.size(0) == n, "rtk_avx2.gemv: scales [N, G]");
    groups = sc.size(1);
    TORCH_CHECK(K % groups == 0 && (K / groups) % 8 == 0, "rtk_avx2.gemv: groups must split K into multiples of 8");
    group = K / groups;
    sp = sc.data_ptr<float>();
  }
  const auto* w = static_cast<const uint8_t*>(weights.data_ptr());
  const int64_t row_bytes = K * weights.element_size();
  if (rows > 0) {
    if (kind == kBf16) gemv_kind<kBf16>(xs.data_ptr<float>(), rows, K, w, row_bytes, sp, groups, group, n, y.data_ptr<float>());
    if (kind == kInt8) gemv_kind<kInt8>(xs.data_ptr<float>(), rows, K, w, row_bytes, sp, groups, group, n, y.data_ptr<float>());
    if (kind == kFp8) gemv_kind<kFp8>(xs.data_ptr<float>(), rows, K, w, row_bytes, sp, groups, group, n, y.data_ptr<float>());
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

// -- W8A8 (INT8 SmoothQuant exports): integer products ---------------------------------------------
//
// The export quantizes each projection's input per tensor, q = clamp(round(x / s), -128, 127) (round
// half to even: checkpoint.fake_quant's float32 division and rounding), and its weights per output
// channel to int8 codes.  The dense path multiplies the dequantized values in float32; here the
// products are summed as integers, 32 a step (vpsignb / vpmaddubsw / vpmaddwd, as llama.cpp's Q8_0
// dot product on AVX2), and scaled once: y = float(sum q * code) * (s * scale[o]).  An integer sum is
// exact in any order, so a row's outputs depend on that row alone: prompt rows and decode rows take
// the same kernel and a sequence's numbers change neither with its batch nor with its prompt's
// chunking.  vpmaddubsw adds two u8 x s8 products into int16 with saturation: |q| <= 128 and codes in
// -127..127 (checked at pack) keep each pair within 2 * 128 * 127 < 32767.

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// y[r * ldy + o] = float(sum_k q[r, k] * w[o, k]) * oscale[o] for R rows and O outputs.
template <int64_t R, int64_t O>
inline void idot(const int8_t* q, const uint8_t* qa, int64_t K, const int8_t* w, const float* oscale, float* y,
                 int64_t ldy) {
  __m256i acc[R][O];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wv[O];
    for (int64_t o = 0; o < O; ++o) {  // the codes 2 KiB ahead: the hardware prefetcher alone fell behind
      _mm_prefetch(reinterpret_cast<const char*>(w + o * K + k + 2048), _MM_HINT_T0);
      wv[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * K + k));
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + r * K + k));
      for (int64_t o = 0; o < O; ++o) {
        const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv[o], qv));
        acc[r][o] = _mm256_add_epi32(acc[r][o], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) y[r * ldy + o] = static_cast<float>(hsum_i32(acc[r][o])) * oscale[o];
}

template <int64_t O>
inline void idot_rows(const int8_t* q, const uint8_t* qa, int64_t rows, int64_t K, const int8_t* w,
                      const float* oscale, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) idot<4, O>(q + r * K, qa + r * K, K, w, oscale, y + r * ldy, ldy);
  switch (rows - r) {
    case 3: idot<3, O>(q + r * K, qa + r * K, K, w, oscale, y + r * ldy, ldy); break;
    case 2: idot<2, O>(q + r * K, qa + r * K, K, w, oscale, y + r * ldy, ldy); break;
    case 1: idot<1, O>(q + r * K, qa + r * K, K, w, oscale, y + r * ldy, ldy); break;
    default: break;
  }
}

constexpr int64_t kRowTile = 16;  // rows whose quantized inputs stay in L1 while a thread's outputs pass

// x [R, K] float32 (the projection's input before its quantization); codes [N, K] int8 in -127..127;
// oscale [N] float32 = act_scale * weight scale[o].
at::Tensor w8a8(const at::Tensor& x, double act_scale, const at::Tensor& codes, const at::Tensor& oscale,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.w8a8: x must be [rows, K] float32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "rtk_avx2.w8a8: codes must be [N, K] int8, contiguous");
  const int64_t rows = x.size(0), K = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "rtk_avx2.w8a8: K must match the codes and be a multiple of 32");
  TORCH_CHECK(oscale.scalar_type() == at::kFloat && oscale.numel() == n && oscale.is_contiguous(),
              "rtk_avx2.w8a8: oscale must be [N] float32");
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // the input's codes, as checkpoint.fake_quant computes them (float32 division, round half to even,
  // clamp); a NaN input has no integer code (it gives -128 here, NaN on the dense path)
  std::vector<int8_t> q(rows * K);
  std::vector<uint8_t> qa(rows * K);
  const float* xp = xs.data_ptr<float>();
  const __m256 sv = _mm256_set1_ps(static_cast<float>(act_scale));
  const __m256 lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  at::parallel_for(0, rows * K / 32, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      __m256i c[4];
      for (int j = 0; j < 4; ++j) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(xp + b * 32 + j * 8), sv);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      }
      const __m256i c8 = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * 32), c8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa.data() + b * 32), _mm256_abs_epi8(c8));
    }
  });
  const auto* w = codes.data_ptr<int8_t>();
  const float* os = oscale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t rt = std::min(kRowTile, rows - r0);
      const int8_t* qr = q.data() + r0 * K;
      const uint8_t* ar = qa.data() + r0 * K;
      int64_t o = o0;
      // one output at a time streams the codes fastest for a row or two (measured: ~8 GB/s against ~5
      // with two); from 3 rows up the products set the pace, and two outputs share each input load
      if (rt >= 3)
        for (; o + 2 <= o1; o += 2) idot_rows<2>(qr, ar, rt, K, w + o * K, os + o, yp + r0 * n + o, n);
      for (; o < o1; ++o) idot_rows<1>(qr, ar, rt, K, w + o * K, os + o, yp + r0 * n + o, n);
    }
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

}  // namespace

TORCH_LIBRARY(rtk_avx2, m) {
  m.def("gemv(Tensor x, Tensor weights, int kind, Tensor? scales, Tensor? bias) -> Tensor", &gemv);
  m.def("w8a8(Tensor x, float act_scale, Tensor codes, Tensor oscale, Tensor? bias) -> Tensor", &w8a8);
}
