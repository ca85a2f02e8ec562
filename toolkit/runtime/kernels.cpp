// rtk's CPU kernels for the decode step (CPUs with AVX512-BF16), each bit-identical to what it replaces
// (1. gemv, 2. gemv_q, 3. quantize_input, 4. gather_kv below).
//
// 1. gemv: bf16 matmul of a few rows (the decode GEMV, y = x W^T [+ b]).
// oneDNN's one-row bf16 kernel (brg_matmul:avx512_core_bf16) reads weights at well below the
// machine's bandwidth here; this kernel streams them.  It computes every output with the same
// arithmetic as oneDNN's kernel, so its results are bit-identical (toolkit/runtime/model.py checks
// that at load for every weight shape and uses the kernel only where it holds).  Each row of a
// multi-row call is computed exactly as a one-row call, so a row's bits never depend on the batch,
// and the weights are read from memory once per call.  The one-row arithmetic:
//   * vdpbf16ps over consecutive pairs of the reduction dimension, one fp32 accumulator per output;
//   * the reduction in chunks of 512 (256 pairs), each chunk's partial sum started from zero and
//     added to the running total in order;
//   * the bias, if any, added in fp32, then one round-to-nearest-even to bf16.
//
// Weights are packed once into blocks of 64 outputs: [ceil(N / 64), K / 2, 64, 2] (outputs padded
// with zeros), so one thread reads each block as one contiguous stream.  Blocks are split across
// torch's intra-op threads (at::parallel_for: the same OpenMP pool as torch's own operators).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;       // outputs per block: 4 zmm accumulators
constexpr int64_t kChunkPairs = 256;  // reduction chunk (pairs), as oneDNN's kernel blocks it

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "rtk_kernels.pack: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "rtk_kernels.pack: in_features must be even");
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock;
  auto w = at::zeros({padded, k}, weight.options());
  w.narrow(0, 0, n).copy_(weight);
  return w.view({padded / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The bf16 weights of one k-pair of one 64-output block, as 4 vectors of 16 outputs x 2 k each.
struct Bf16Weights {
  const uint16_t* base;  // the block's first k-pair
  inline void begin_group(int64_t) {}
  inline void load(int64_t k, __m512bh w[4]) const {
    const uint16_t* row = base + k * kBlock * 2;
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + 32 * j);
  }
};

// Rows [r0, r0 + R) of x times one 64-output block: every row with the one-row arithmetic above.
// The block's chunk of weights is read from memory once and from cache for the other rows.
template <int R, class Weights>
inline void block_rows(const uint32_t* xs, int64_t r0, Weights& weights, int64_t pairs, int64_t group_pairs,
                       float* total) {
  int64_t next_group = 0;
  for (int64_t k0 = 0; k0 < pairs; k0 += kChunkPairs) {
    const int64_t k1 = std::min(pairs, k0 + kChunkPairs);
    __m512 p[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) p[r][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      if (k == next_group) weights.begin_group(k / group_pairs), next_group += group_pairs;
      __m512bh w[4];
      weights.load(k, w);
      for (int r = 0; r < R; ++r) {
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[(r0 + r) * pairs + k]));
        for (int j = 0; j < 4; ++j) p[r][j] = _mm512_dpbf16_ps(p[r][j], xk, w[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) {
        float* t = total + (r * 4 + j) * 16;
        _mm512_storeu_ps(t, k0 == 0 ? p[r][j] : _mm512_add_ps(_mm512_loadu_ps(t), p[r][j]));
      }
  }
}

// y = x W^T (+ bias) over the blocks, rows in groups of 4; make_weights(b) gives block b's loader.
template <class MakeWeights>
at::Tensor gemv_blocks(const at::Tensor& x, int64_t blocks, int64_t pairs, int64_t group_pairs, int64_t n,
                       const c10::optional<at::Tensor>& bias, MakeWeights make_weights) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "rtk_kernels: x is [M, K] bf16");
  TORCH_CHECK(x.size(1) == 2 * pairs && n <= blocks * kBlock, "rtk_kernels: shapes do not match");
  const int64_t m = x.size(0);
  auto xc = x.contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  const auto* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const float* bs = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float total[4 * kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        auto weights = make_weights(b);
        const int rows = static_cast<int>(std::min<int64_t>(4, m - r0));
        switch (rows) {
          case 4: block_rows<4>(xs, r0, weights, pairs, group_pairs, total); break;
          case 3: block_rows<3>(xs, r0, weights, pairs, group_pairs, total); break;
          case 2: block_rows<2>(xs, r0, weights, pairs, group_pairs, total); break;
          default: block_rows<1>(xs, r0, weights, pairs, group_pairs, total); break;
        }
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < 4; ++j) {
            const int64_t first = b * kBlock + j * 16;
            if (first >= n) break;
            const int64_t count = std::min<int64_t>(16, n - first);
            const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
            __m512 v = _mm512_loadu_ps(total + (r * 4 + j) * 16);
            if (bs) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bs + first));
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_mask_storeu_epi16(ys + (r0 + r) * n + first, mask, out);
          }
      }
    }
  });
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  const int64_t blocks = packed.size(0), pairs = packed.size(1);
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  return gemv_blocks(x, blocks, pairs, pairs, n, bias,
                     [&](int64_t b) { return Bf16Weights{ws + b * pairs * kBlock * 2}; });
}

// 2. gemv_q: the same GEMV reading 8-bit (int8, fp8 e4m3) or 4-bit (int4) weight codes with their
//    float32 scales (per output, or per output and group of inputs), each weight turned back into
//    bf16(float(code) * scale) in registers, which is the dequantized weight that the dense path
//    rounds to bf16 (toolkit/runtime/checkpoint.py: ``codes.float() * scale``, then ``.to(bf16)``):
//    the product is one float32 multiplication rounded to nearest even, the bf16 conversion
//    (vcvtne2ps2bf16) rounds to nearest even as torch's does.  With the same weights the GEMV
//    arithmetic is the bf16 one above, so the results are its bits; :func:`unpack_q` gives the
//    weights back for the check at load.
//
//    Codes are packed as the bf16 weights, [ceil(N/64), K/2, 64, 2]: one byte per code (8-bit),
//    or one byte per two codes (4-bit: the byte at position i of a 16-output group holds element i
//    of the group's first 32-value vector in its low nibble and element i of its second in its
//    high nibble, both offset by 8).  Scales: [ceil(N/64), groups, 128] float32, element
//    (16j + 8h + i/2) of a block's group duplicated into slots 32j + 16h + i, the order of the
//    two-vector halves, so one scale vector multiplies 16 converted codes.
//    fp8 e4m3: the byte's magnitude bits shifted into a float16 (exponent bias 15 instead of 7,
//    subnormals included) and converted exactly, with 2^8 folded into the scale (exact).

enum QuantKind : int64_t { kInt8 = 0, kFp8 = 1, kInt4 = 2 };

inline __m512 codes8_to_float(__m128i bytes, int64_t kind) {
  if (kind == kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  // sign-extended to 16 bits and shifted by 7: magnitude at bits 7-13, sign at 14 and 15; drop bit 14
  const __m256i v = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(v, _mm256_set1_epi16(static_cast<short>(0xBF80))));
}

const __m512 kInt4Values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);

template <int64_t Kind>
struct QuantWeights {
  const uint8_t* codes;  // the block's first k-pair
  const float* scales;   // the block's [groups, 128]
  __m512 s[8];
  inline void begin_group(int64_t g) {
    for (int i = 0; i < 8; ++i) s[i] = _mm512_loadu_ps(scales + g * 128 + 16 * i);
  }
  inline void load(int64_t k, __m512bh w[4]) const {
    if constexpr (Kind == kInt4) {
      const uint8_t* row = codes + k * kBlock;
      for (int j = 0; j < 4; ++j) {
        // vpermps reads the low 4 bits of each index: the table maps an offset code to its value
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
        const __m512 lo = _mm512_permutexvar_ps(b, kInt4Values);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), kInt4Values);
        w[j] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s[2 * j + 1]), _mm512_mul_ps(lo, s[2 * j]));
      }
    } else {
      const uint8_t* row = codes + k * kBlock * 2;
      for (int j = 0; j < 4; ++j) {
        const __m512 lo = codes8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * j)), Kind);
        const __m512 hi = codes8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * j + 16)), Kind);
        w[j] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s[2 * j + 1]), _mm512_mul_ps(lo, s[2 * j]));
      }
    }
  }
  // the block's bf16 weights in the Bf16Weights layout
  inline void rebuild(uint16_t* out, int64_t pairs, int64_t group_pairs) {
    __m512bh w[4];
    for (int64_t k = 0; k < pairs; ++k) {
      if (k % group_pairs == 0) begin_group(k / group_pairs);
      load(k, w);
      for (int j = 0; j < 4; ++j) _mm512_storeu_si512(out + (k * kBlock + 16 * j) * 2, (__m512i)w[j]);
    }
  }
};

// codes: [N, K] int8 (int8, or int4 values in -8..7) or uint8 (fp8 e4m3 bits) -> the packed layout above
at::Tensor pack_q(const at::Tensor& codes, int64_t kind) {
  TORCH_CHECK(codes.dim() == 2 && codes.element_size() == 1, "rtk_kernels.pack_q: 2-D one-byte codes");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % 2 == 0, "rtk_kernels.pack_q: in_features must be even");
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock, blocks = padded / kBlock;
  auto c = at::zeros({padded, k}, codes.options().dtype(at::kByte));
  c.narrow(0, 0, n).copy_(codes.view(at::kByte));
  // [blocks, K/2, 64, 2]: the bf16 layout, one byte per code
  auto inter = c.view({blocks, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  if (kind != kInt4) return inter;
  // 4-bit: within each 16-output group's 32 values, value i (first vector) and 16 + i (second) share byte i
  auto v = inter.view({blocks, k / 2, 4, 2, 16}).to(at::kInt).add(8).bitwise_and(15);  // offset codes (zero padding -> 8)
  auto lo = v.select(3, 0), hi = v.select(3, 1);
  return lo.add(hi.mul(16)).to(at::kByte).contiguous();  // [blocks, K/2, 4, 16]
}

// scale: [N] or [N, groups] float32 -> [blocks, groups, 128] (padding: zero scales)
at::Tensor pack_scales(const at::Tensor& scale) {
  auto s = scale.to(at::kFloat);
  if (s.dim() == 1) s = s.unsqueeze(1);
  const int64_t n = s.size(0), groups = s.size(1);
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock, blocks = padded / kBlock;
  auto p = at::zeros({padded, groups}, s.options());
  p.narrow(0, 0, n).copy_(s);
  // output 64b + 16j + 8h + i/2 -> slot 32j + 16h + i: each output's scale twice, in output order
  return p.view({blocks, kBlock, groups}).permute({0, 2, 1}).repeat_interleave(2, 2).contiguous();
}

template <int64_t Kind>
at::Tensor gemv_q_kind(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t blocks = codes.size(0), pairs = codes.size(1), groups = scales.size(1);
  TORCH_CHECK(scales.size(0) == blocks && pairs % groups == 0, "rtk_kernels.gemv_q: scales do not match codes");
  const int64_t per_pair = Kind == kInt4 ? kBlock : kBlock * 2;
  const auto* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  return gemv_blocks(x, blocks, pairs, pairs / groups, n, bias, [&](int64_t b) {
    return QuantWeights<Kind>{cs + b * pairs * per_pair, ss + b * groups * 128, {}};
  });
}

at::Tensor gemv_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t kind, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.dim() == 3,
              "rtk_kernels.gemv_q: packed codes and scales (pack_q, pack_scales)");
  if (kind == kInt8) return gemv_q_kind<kInt8>(x, codes, scales, n, bias);
  if (kind == kFp8) return gemv_q_kind<kFp8>(x, codes, scales, n, bias);
  TORCH_CHECK(kind == kInt4, "rtk_kernels.gemv_q: kind is 0 (int8), 1 (fp8) or 2 (int4)");
  return gemv_q_kind<kInt4>(x, codes, scales, n, bias);
}

// The bf16 weights gemv_q computes with, [N, K] (for the check at load against the dense weights).
at::Tensor unpack_q(const at::Tensor& codes, const at::Tensor& scales, int64_t kind, int64_t n) {
  const int64_t blocks = codes.size(0), pairs = codes.size(1), groups = scales.size(1);
  auto out = at::empty({blocks, pairs, kBlock, 2}, at::kBFloat16);
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t per_pair = kind == kInt4 ? kBlock : kBlock * 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* c = codes.data_ptr<uint8_t>() + b * pairs * per_pair;
    const float* s = scales.data_ptr<float>() + b * groups * 128;
    uint16_t* o = os + b * pairs * kBlock * 2;
    if (kind == kInt8) QuantWeights<kInt8>{c, s, {}}.rebuild(o, pairs, pairs / groups);
    else if (kind == kFp8) QuantWeights<kFp8>{c, s, {}}.rebuild(o, pairs, pairs / groups);
    else QuantWeights<kInt4>{c, s, {}}.rebuild(o, pairs, pairs / groups);
  }
  return out.permute({0, 2, 1, 3}).reshape({blocks * kBlock, pairs * 2}).narrow(0, 0, n).contiguous();
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 3. quantize_input: what the dense path does to a projection's input before the matmul
//    (toolkit/runtime/checkpoint.py Linear / fake_quant), in one pass instead of up to eight torch
//    operators: x * pre_quant_scale (bf16 product), then the activation quantize-dequantize in
//    float32: fp8 e4m3 (x / s clamped to +-448, rounded to nearest even by c10's conversion, times s)
//    or int8 (x / s rounded half to even, clamped to [-128, 127], times s), rounded back to bf16.
//    Each step is the same IEEE operation torch performs, in the same order.

// float32 -> bf16 bits, rounded to nearest even as c10::BFloat16 does (subnormals kept), 16 lanes
inline __m512i bf16_round_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

inline __m512 bf16_bits_to_float(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// float32 (|q| <= 448) -> the float32 value of its float8_e4m3fn rounding (nearest even): 3 mantissa
// bits for normal values (>= 2^-6), multiples of 2^-9 below (e4m3's subnormals)
inline __m512 round_to_e4m3(__m512 q) {
  const __m512i u = _mm512_castps_si512(q);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFFF))),
                                          _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, u));
  const __m512 big = _mm512_set1_ps(16384.0f);  // ulp 2^-9 just above it
  const __m512i sub = _mm512_or_si512(sign, _mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(a, big), big)));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
}

at::Tensor quantize_input(const at::Tensor& x, const c10::optional<at::Tensor>& pre_quant_scale, int64_t act_kind,
                          double act_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "rtk_kernels.quantize_input: x is [M, K] bf16");
  const int64_t m = x.size(0), k = x.size(1);
  auto xc = x.contiguous();
  at::Tensor pq;
  if (pre_quant_scale.has_value()) {
    pq = pre_quant_scale->to(at::kBFloat16).contiguous();
    TORCH_CHECK(pq.numel() == k, "rtk_kernels.quantize_input: pre_quant_scale has in_features values");
  }
  auto y = at::empty_like(xc);
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* ps = pre_quant_scale.has_value() ? reinterpret_cast<const uint16_t*>(pq.data_ptr()) : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  const __m512 s = _mm512_set1_ps(static_cast<float>(act_scale));
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < k; c += 16) {
        const __mmask16 mask = static_cast<__mmask16>(k - c >= 16 ? 0xFFFF : (1u << (k - c)) - 1);
        __m512 v = bf16_bits_to_float(_mm256_maskz_loadu_epi16(mask, xs + r * k + c));
        if (ps) {  // the bf16 product x * pre_quant_scale
          v = _mm512_mul_ps(v, bf16_bits_to_float(_mm256_maskz_loadu_epi16(mask, ps + c)));
          v = _mm512_castsi512_ps(bf16_round_bits(v));
        }
        if (act_kind == 1) {
          __m512 q = _mm512_div_ps(v, s);
          q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
          v = _mm512_mul_ps(round_to_e4m3(q), s);
        } else if (act_kind == 2) {
          __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
          v = _mm512_mul_ps(q, s);
        }
        const __m256i out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16));
        _mm256_mask_storeu_epi16(ys + r * k + c, mask, out);
      }
  });
  return y;
}

// 4. gather_kv: K and V rows of the paged cache at the given slots, bf16 -> float32 in one pass
//    (exact: every bf16 value is a float32 value), for float32 attention.

std::vector<at::Tensor> gather_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.is_contiguous() &&
                  v.is_contiguous() && k.sizes() == v.sizes() && slots.scalar_type() == at::kLong,
              "rtk_kernels.gather_kv: contiguous bf16 K and V of one shape, int64 slots");
  const int64_t row = k.numel() / k.size(0), rows = k.size(0);
  auto sc = slots.contiguous();
  const int64_t n = sc.numel();
  std::vector<int64_t> shape(k.sizes().begin(), k.sizes().end());
  shape[0] = n;
  auto ko = at::empty(shape, k.options().dtype(at::kFloat));
  auto vo = at::empty(shape, k.options().dtype(at::kFloat));
  const auto* idx = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, "rtk_kernels.gather_kv: slot out of range");
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  float* kd = ko.data_ptr<float>();
  float* vd = vo.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const uint16_t* kr = ks + idx[i] * row;
      const uint16_t* vr = vs + idx[i] * row;
      float* kw = kd + i * row;
      float* vw = vd + i * row;
      for (int64_t j = 0; j < row; ++j) kw[j] = bf16_to_float(kr[j]), vw[j] = bf16_to_float(vr[j]);
    }
  });
  return {ko, vo};
}

}  // namespace

TORCH_LIBRARY(rtk_kernels, m) {
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("gemv(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &gemv);
  m.def("pack_q(Tensor codes, int kind) -> Tensor", &pack_q);
  m.def("pack_scales(Tensor scale) -> Tensor", &pack_scales);
  m.def("gemv_q(Tensor x, Tensor codes, Tensor scales, int kind, int n, Tensor? bias) -> Tensor", &gemv_q);
  m.def("unpack_q(Tensor codes, Tensor scales, int kind, int n) -> Tensor", &unpack_q);
  m.def("quantize_input(Tensor x, Tensor? pre_quant_scale, int act_kind, float act_scale) -> Tensor", &quantize_input);
  m.def("gather_kv(Tensor k, Tensor v, Tensor slots) -> Tensor[]", &gather_kv);
}
