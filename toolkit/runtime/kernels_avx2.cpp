// rtk's kernels for float32 engines on CPUs without native bf16 dot products (AVX2 + FMA: Zen 1-3,
// Haswell to Ice Lake client parts, and AVX512 server parts without BF16, Skylake-SP to Ice Lake, where
// kernels_avx2.py builds this file with VNNI as rtk_vnni: dot4_add, and 512-bit tiles for many rows:
// dot_wide, idot_wide, idot4_wide), in four parts: the decode GEMV (this header), INT8 SmoothQuant as integer
// products (w8a8, below), weight-only INT8 and INT4 as integer products over inputs quantized per block of
// 32 (w8a8_blockwise, w4a8) and the fused decode step (DecodeLayers, whose prompt rows take MKL's packed GEMM
// through mkl_tiles, or with float32_prompt_rows "gemv" the GEMV's calls of many rows, where they are not integer
// products).
//
// The decode GEMV.  Where the engine computes in float32 (model.resolve_dtype), the dense path reads
// float32 weights: 4 bytes a weight, twice bf16's.  This kernel reads the weights as they
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
#include <cstring>
#include <utility>
#include <vector>

#include "amx_tiles.h"  // w4a8_tiles
#include "argmax_rows.h"
#include "decode_attention.h"
#include "decode_plan.h"

namespace {

constexpr int64_t kBf16 = 0, kInt8 = 1, kFp8 = 2;
constexpr int64_t kRowBlock = 4;  // rows sharing one decode of a weight chunk

template <int64_t Kind>
inline __m256 decode8(const uint8_t* w, int64_t k) {  // int8 / fp8 codes (bf16: bf16_block)
  if constexpr (Kind == kInt8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {  // e4m3 sign-extended: bits 31..7 the sign, 6..0 exponent and mantissa; into float32's places
    __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(0x87F00000u)));
  }
}

inline float hsum(__m256 a, __m256 b) { return rtk_attention::lane_sum(_mm256_add_ps(a, b)); }

// tile(R, r) for the rows of a call in tiles of 4 (R a std::integral_constant, a kernel's template argument;
// r the tile's first row), then one tile of the 3, 2 or 1 left: every kernel below walks its rows so.
template <typename Tile>
inline void by_row_tiles(int64_t rows, Tile&& tile) {
  static_assert(kRowBlock == 4, "by_row_tiles: the rows left are 3, 2 or 1");
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) tile(std::integral_constant<int64_t, kRowBlock>{}, r);
  switch (rows - r) {
    case 3: tile(std::integral_constant<int64_t, 3>{}, r); break;
    case 2: tile(std::integral_constant<int64_t, 2>{}, r); break;
    case 1: tile(std::integral_constant<int64_t, 1>{}, r); break;
    default: break;
  }
}

// out[r] = sum_k x[r, k] * w[k] for rows r < R (R <= kRowBlock) of one output's weights.
template <int64_t Kind>
inline __m256 weights8(const uint8_t* w, __m256 scale, int64_t k) {
  __m256 v = decode8<Kind>(w, k);
  if constexpr (Kind != kBf16) v = _mm256_mul_ps(v, scale);
  return v;
}

// bf16 weights 0-7 and 8-15 of a block of 16 stored in kernels_avx2.UNPACK_ORDER (each 128-bit lane's low four
// words are among 0-7, its high four among 8-15): unpacked against zeros, each word becomes its float32, bits << 16
inline void bf16_block(const uint8_t* b, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

// out[r * out_stride] = sum_k x[r, k] * w[k] for rows r < R (R <= kRowBlock) of one output's weights:
// group by group, inputs 16 at a time into two accumulators (a group's last 8 into the first), then
// one fixed horizontal sum.  bf16 weights are one group of blocks of 16 (bf16_block), step bytes apart
// (kernels_avx2.bf16_unpack_order: 64 where outputs are paired, 32 for an odd N's last).
template <int64_t Kind, int64_t R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* w, int64_t step, const float* scales, int64_t group,
                     float* out, int64_t out_stride) {
  __m256 acc0[R], acc1[R];
  for (int64_t r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const __m256 scale = _mm256_set1_ps(Kind == kBf16 ? 1.0f : scales[g0 / group]);
    const int64_t g1 = g0 + group;
    int64_t k = g0;
    for (; k + 16 <= g1; k += 16) {
      __m256 w0, w1;
      if constexpr (Kind == kBf16) {
        bf16_block(w + (k / 16) * step, w0, w1);
      } else {
        if (R > 1 && k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k + 1024), _MM_HINT_T0);
        w0 = weights8<Kind>(w, scale, k);
        w1 = weights8<Kind>(w, scale, k + 8);
      }
      for (int64_t r = 0; r < R; ++r) {
        acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc1[r]);
      }
    }
    if constexpr (Kind != kBf16) {
      if (k < g1) {
        const __m256 w0 = weights8<Kind>(w, scale, k);
        for (int64_t r = 0; r < R; ++r) acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc0[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) out[r * out_stride] = hsum(acc0[r], acc1[r]);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The VNNI build's GEMV: one 512-bit register holds an output pair's
// accumulators side by side (lanes 0-7 output o, 8-15 output o + 1), the pair's weights at k (bf16: one
// 64-byte load of the pair's block, both outputs' 16 unpacked by two instructions; codes: 8 from each
// output's row), the row's 8 inputs broadcast to both halves, the pair's group scales one to a half.  Each
// half does, lane for lane, what dot_rows does in its 256-bit register (the same conversions, products by the
// scale, multiply-adds in the same order, the same final sum): the same bits with half the multiply-adds and
// input loads, and each input load shared by P pairs.
#define RTK_WIDE_TILES 1
constexpr int64_t kWideRows = 2;  // a call of one row keeps idot / idot4 (bound by the weights' bytes); the GEMV not
constexpr int64_t kWideGemvPairs = 2;  // output pairs a GEMV tile: 16 accumulators (4 rows x 2 pairs x 2)

inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

template <int64_t Kind>
inline __m512 codes8_pair(const uint8_t* w0, const uint8_t* w1, __m512 scale, int64_t k) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w0 + k)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w1 + k)));
  __m512 v;
  if constexpr (Kind == kInt8) {
    v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    v = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(b), 20), _mm512_set1_epi32(0x87F00000u)));
  }
  return _mm512_mul_ps(v, scale);
}

inline __m512 broadcast8(const float* p) {  // 8 floats into both halves
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// out[r * ldy + 2p (+1)] for rows r < R and P output pairs (w: the first pair's weights, pair_bytes apart):
// dot_rows' arithmetic, two outputs a register.
template <int64_t Kind, int64_t R, int64_t P>
inline void dot_wide(const float* x, int64_t K, const uint8_t* w, int64_t pair_bytes, const float* scales,
                     int64_t groups, int64_t group, float* y, int64_t ldy) {
  __m512 acc0[R][P], acc1[R][P];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) acc0[r][p] = acc1[r][p] = _mm512_setzero_ps();
  const int64_t row_bytes = pair_bytes / 2;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m512 scale[P];
    for (int64_t p = 0; p < P; ++p)
      scale[p] = Kind == kBf16 ? _mm512_set1_ps(1.0f)
                               : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scales[2 * p * groups + g0 / group]),
                                                      _mm512_set1_ps(scales[(2 * p + 1) * groups + g0 / group]));
    const int64_t g1 = g0 + group;
    int64_t k = g0;
    for (; k + 16 <= g1; k += 16) {
      __m512 w0[P], w1[P];
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* a = w + p * pair_bytes;
        if constexpr (Kind == kBf16) {  // lanes 0-1: output 2p's block, 2-3: output 2p + 1's (bf16_block)
          _mm_prefetch(reinterpret_cast<const char*>(a + 4 * k + 2048), _MM_HINT_T0);  // 2 KiB ahead (streamed weights)
          const __m512i v = _mm512_loadu_si512(a + 4 * k);
          w0[p] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
          w1[p] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
        } else {
          if (k % 64 == 0) {  // each output's codes 1 KiB ahead, a cache line a time
            _mm_prefetch(reinterpret_cast<const char*>(a + k + 1024), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(a + row_bytes + k + 1024), _MM_HINT_T0);
          }
          w0[p] = codes8_pair<Kind>(a, a + row_bytes, scale[p], k);
          w1[p] = codes8_pair<Kind>(a, a + row_bytes, scale[p], k + 8);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xa = broadcast8(x + r * K + k), xb = broadcast8(x + r * K + k + 8);
        for (int64_t p = 0; p < P; ++p) {
          acc0[r][p] = _mm512_fmadd_ps(w0[p], xa, acc0[r][p]);
          acc1[r][p] = _mm512_fmadd_ps(w1[p], xb, acc1[r][p]);
        }
      }
    }
    if constexpr (Kind != kBf16) {
      if (k < g1) {
        __m512 w0[P];
        for (int64_t p = 0; p < P; ++p) {
          const uint8_t* a = w + p * pair_bytes;
          w0[p] = codes8_pair<Kind>(a, a + row_bytes, scale[p], k);
        }
        for (int64_t r = 0; r < R; ++r) {
          const __m512 xa = broadcast8(x + r * K + k);
          for (int64_t p = 0; p < P; ++p) acc0[r][p] = _mm512_fmadd_ps(w0[p], xa, acc0[r][p]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) {
      y[r * ldy + 2 * p] = hsum(low_half(acc0[r][p]), low_half(acc1[r][p]));
      y[r * ldy + 2 * p + 1] = hsum(high_half(acc0[r][p]), high_half(acc1[r][p]));
    }
}
#endif

// dot_rows of a bf16 output pair (kernels_avx2.bf16_unpack_order): each 64-byte block read once, its first 32 bytes
// output 2p's 16 weights, the rest output 2p + 1's; each output's accumulators and sums as dot_rows'.
template <int64_t R>
inline void dot_rows_bf16_pair(const float* x, int64_t K, const uint8_t* w, float* out, int64_t out_stride) {
  __m256 acc0[2][R], acc1[2][R];
  for (int64_t j = 0; j < 2; ++j)
    for (int64_t r = 0; r < R; ++r) acc0[j][r] = acc1[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    // streamed weights ahead: 2 KiB in tiles of 2-4 rows, 512 bytes for a lone row (SmolLM2's bf16 weights on Zen 2:
    // a lone row's pass ~10 % faster at 512 bytes, 5-10 % slower at 2 KiB)
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * k + (R > 1 ? 2048 : 512)), _MM_HINT_T0);
    __m256 w0[2], w1[2];
    for (int64_t j = 0; j < 2; ++j) bf16_block(w + 4 * k + 32 * j, w0[j], w1[j]);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xa = _mm256_loadu_ps(x + r * K + k), xb = _mm256_loadu_ps(x + r * K + k + 8);
      for (int64_t j = 0; j < 2; ++j) {
        acc0[j][r] = _mm256_fmadd_ps(w0[j], xa, acc0[j][r]);
        acc1[j][r] = _mm256_fmadd_ps(w1[j], xb, acc1[j][r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2; ++j) out[r * out_stride + j] = hsum(acc0[j][r], acc1[j][r]);
}

// -- Calls of many rows (prompt rows): each output's weights made into float32 once, then register tiles --
//
// dot_rows decodes a weight chunk for the 4 rows of its tile, and its 4 rows x 2 accumulators leave few registers,
// so many rows ran at ~60 % of MKL's sgemm rate on a Zen 2 host.  From kManyRows rows on (gemv_many), a thread
// writes kManyOutputs outputs' weights into a float32 scratch (the decoded, scaled values dot_rows makes in
// registers: the same floats), then takes the rows 4 at a time over it, block by block of inputs (dot_tile_rows),
// each (row, output) pair with dot_rows' two accumulators, multiply-adds in the same order and the same final sum:
// the same bits as a call of one row.  Rows go in blocks whose inputs stay in L2 (kManyInputBytes), the scratch
// made again for each block.  On 2 Zen 2 cores: ~69 GMAC/s at 64 rows and more, MKL's own rate (dot_rows: ~46).
constexpr int64_t kManyRows = 8;
constexpr int64_t kManyOutputs = 3;  // 4 rows (by_row_tiles) x 3 outputs: 12 accumulators, 3 weights, 1 input
constexpr int64_t kManyInputBytes = 192 * 1024;
constexpr int64_t kManyBlock = 576;  // inputs a block: 4 rows' and 3 outputs' of it take 16 KiB of L1
static_assert(kManyBlock % 16 == 0, "a block of inputs holds whole pairs of 8-input chunks");

// Where output o's weights start in w, and the bytes between its blocks of 16 (the step dot_rows takes): codes a row
// each; bf16 paired (kernels_avx2.bf16_unpack_order: output o's block of 16 at k lies at w + (o - o % 2) * row_bytes
// + 4k + 32 (o % 2), step 64), an odd N's last output alone (step 32).
template <int64_t Kind>
inline std::pair<const uint8_t*, int64_t> output_weights(const uint8_t* w, int64_t w_row_bytes, int64_t o,
                                                         int64_t pairs) {
  if (Kind != kBf16 || o >= 2 * pairs) return {w + o * w_row_bytes, 32};
  return {w + (o - o % 2) * w_row_bytes + 32 * (o % 2), 64};
}

// dst[k] = output o's weight k as dot_rows makes it (bf16 bits << 16; codes times their group's scale)
template <int64_t Kind>
inline void decode_output(const uint8_t* w, int64_t w_row_bytes, int64_t o, int64_t pairs, const float* scales,
                          int64_t group, int64_t K, float* dst) {
  if constexpr (Kind == kBf16) {
    const auto [wo, step] = output_weights<Kind>(w, w_row_bytes, o, pairs);
    for (int64_t k = 0; k < K; k += 16) {
      __m256 w0, w1;
      bf16_block(wo + (k / 16) * step, w0, w1);
      _mm256_storeu_ps(dst + k, w0);
      _mm256_storeu_ps(dst + k + 8, w1);
    }
  } else {
    const uint8_t* wo = w + o * w_row_bytes;
    const float* so = scales + o * (K / group);
    for (int64_t g0 = 0; g0 < K; g0 += group) {
      const __m256 scale = _mm256_set1_ps(so[g0 / group]);
      for (int64_t k = g0; k < g0 + group; k += 8) _mm256_storeu_ps(dst + k, weights8<Kind>(wo, scale, k));
    }
  }
}

// Accumulator h of row r and output c (8 lanes at acc + ((r * 2 + h) * C + c) * 8) += the products of inputs
// [b0, b1) of R rows and C outputs (weights ws[c * K + k]) in dot_rows' order: per group, inputs 16 at a time into
// two accumulators h (a group's last 8 into the first).  The block's inputs stay in L1, and its two accumulators are
// filled one after the other, each in its own order, so a tile holds R x C of them in registers, not twice that.
// step: the span whose chunks alternate between the two (a group, or the whole block where groups are multiples of
// 16).
template <int64_t R, int64_t C>
inline void dot_tile(const float* x, int64_t K, const float* ws, int64_t b0, int64_t b1, int64_t step, float* acc) {
  for (int64_t h = 0; h < 2; ++h) {
    __m256 a[R][C];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) a[r][c] = _mm256_load_ps(acc + ((r * 2 + h) * C + c) * 8);
    for (int64_t g0 = b0; g0 < b1; g0 += step)
      for (int64_t k = g0 + 8 * h; k < g0 + step; k += 16) {
        __m256 wv[C];
        for (int64_t c = 0; c < C; ++c) wv[c] = _mm256_load_ps(ws + c * K + k);
        for (int64_t r = 0; r < R; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * K + k);
          for (int64_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
        }
      }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) _mm256_store_ps(acc + ((r * 2 + h) * C + c) * 8, a[r][c]);
  }
}

// y[r * ldy + c] for rows r < rows and C outputs whose float32 weights are ws: blocks of kManyBlock inputs (whole
// groups where a group's 8-input chunks are odd in number), each through every row before the next, so that a
// block's weights stay in L1; then one fixed horizontal sum, dot_rows' own.
template <int64_t C>
inline void dot_tile_rows(const float* x, int64_t rows, int64_t K, const float* ws, int64_t group, float* acc,
                          float* y, int64_t ldy) {
  std::fill(acc, acc + rows * 2 * C * 8, 0.0f);
  const bool even = group % 16 == 0;  // chunks alternate across group boundaries too
  const int64_t block = even ? kManyBlock : group * std::max<int64_t>(1, kManyBlock / group);
  for (int64_t b0 = 0; b0 < K; b0 += block) {
    const int64_t b1 = std::min(K, b0 + block), step = even ? b1 - b0 : group;
    by_row_tiles(rows, [&](auto R, int64_t r) {
      dot_tile<decltype(R)::value, C>(x + r * K, K, ws, b0, b1, step, acc + r * 2 * C * 8);
    });
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < C; ++c)
      y[r * ldy + c] = hsum(_mm256_load_ps(acc + (r * 2 * C + c) * 8), _mm256_load_ps(acc + ((r * 2 + 1) * C + c) * 8));
}

template <int64_t Kind>
void gemv_many(const float* x, int64_t rows, int64_t K, const uint8_t* w, int64_t w_row_bytes, const float* scales,
               int64_t group, int64_t n, float* y) {
  const int64_t tiles = (n + kManyOutputs - 1) / kManyOutputs, pairs = n / 2;
  const int64_t block = std::min(rows, std::max<int64_t>(kRowBlock, kManyInputBytes / (4 * K)));
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    // a tile's weights and its rows' sums, 64-byte aligned by torch's CPU allocator: no 256-bit load splits a cache
    // line (in a std::vector, 16-byte aligned, the tiles ran ~25 % slower)
    const at::Tensor weights = at::empty({kManyOutputs * K}, at::kFloat);
    const at::Tensor sums = at::empty({block * 2 * kManyOutputs * 8}, at::kFloat);
    float* const scratch = weights.data_ptr<float>();
    float* const acc = sums.data_ptr<float>();
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t rb = std::min(block, rows - r0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o0 = t * kManyOutputs, c = std::min(kManyOutputs, n - o0);
        for (int64_t j = 0; j < c; ++j)
          decode_output<Kind>(w, w_row_bytes, o0 + j, pairs, scales, group, K, scratch + j * K);
        const float* xr = x + r0 * K;
        float* yr = y + r0 * n + o0;
        if (c == 3) dot_tile_rows<3>(xr, rb, K, scratch, group, acc, yr, n);
        if (c == 2) dot_tile_rows<2>(xr, rb, K, scratch, group, acc, yr, n);
        if (c == 1) dot_tile_rows<1>(xr, rb, K, scratch, group, acc, yr, n);
      }
    }
  });
}

template <int64_t Kind>
void gemv_kind(const float* x, int64_t rows, int64_t K, const uint8_t* w, int64_t w_row_bytes, const float* scales,
               int64_t groups, int64_t group, int64_t n, float* y) {
  const int64_t pairs = n / 2;
  const auto one_output = [&](int64_t o, int64_t r, auto R) {  // dot_rows of output o (bf16: paired, or N's last)
    const auto [wo, step] = output_weights<Kind>(w, w_row_bytes, o, pairs);
    dot_rows<Kind, decltype(R)::value>(x + r * K, K, wo, step, scales == nullptr ? nullptr : scales + o * groups,
                                       group, y + r * n + o, n);
  };
#ifdef RTK_WIDE_TILES
  // every row count, one row too: 1.27-1.36x the 256-bit kernel over a model's FP8 or bf16 weights
  at::parallel_for(0, pairs + n % 2, 8, [&](int64_t p0, int64_t p1) {
    const int64_t pe = std::min(p1, pairs);
    for (int64_t p = p0; p < pe; p += std::min(kWideGemvPairs, pe - p)) {
      const uint8_t* wp = w + 2 * p * w_row_bytes;
      const float* sp = scales == nullptr ? nullptr : scales + 2 * p * groups;
      float* yp = y + 2 * p;
      by_row_tiles(rows, [&](auto R, int64_t r) {
        constexpr int64_t kR = decltype(R)::value;
        if (pe - p >= kWideGemvPairs)
          dot_wide<Kind, kR, kWideGemvPairs>(x + r * K, K, wp, 2 * w_row_bytes, sp, groups, group, yp + r * n, n);
        else
          dot_wide<Kind, kR, 1>(x + r * K, K, wp, 2 * w_row_bytes, sp, groups, group, yp + r * n, n);
      });
    }
    if (p1 > pairs) by_row_tiles(rows, [&](auto R, int64_t r) { one_output(n - 1, r, R); });
  });
#else
  if (rows >= kManyRows) return gemv_many<Kind>(x, rows, K, w, w_row_bytes, scales, group, n, y);
  if constexpr (Kind == kBf16) {
    at::parallel_for(0, pairs + n % 2, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < std::min(p1, pairs); ++p)
        by_row_tiles(rows, [&](auto R, int64_t r) {
          dot_rows_bf16_pair<decltype(R)::value>(x + r * K, K, w + 2 * p * w_row_bytes, y + r * n + 2 * p, n);
        });
      if (p1 > pairs) by_row_tiles(rows, [&](auto R, int64_t r) { one_output(n - 1, r, R); });
    });
    return;
  }
  at::parallel_for(0, n, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) by_row_tiles(rows, [&](auto R, int64_t r) { one_output(o, r, R); });
  });
#endif
}

// x [R, K] float32; weights [N, K] (kind: 0 bf16 bits int16 in kernels_avx2.bf16_unpack_order, 1 int8 codes,
// 2 e4m3 bits uint8);// scales [N, G] float32 (int8, fp8; fp8's already times 2^120) or None (bf16).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weights, int64_t kind, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.gemv: x must be [rows, K] float32");
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous(), "rtk_avx2.gemv: weights must be [N, K] contiguous");
  const int64_t rows = x.size(0), K = x.size(1), n = weights.size(0);
  TORCH_CHECK(weights.size(1) == K && K % (kind == kBf16 ? 16 : 8) == 0,
              "rtk_avx2.gemv: K must match the weights and be a multiple of 8 (bf16: 16)");
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

// -- A projection's input quantization (quantize_input) ---------------------------------------------
//
// What model.Projection does to a float32 input before its matmul (checkpoint.Linear / fake_quant): x *
// pre_quant_scale, then the activation's quantize-dequantize, fp8 e4m3 (x / s clamped to +-448, rounded to
// nearest even by c10's conversion, times s) or int8 (x / s rounded half to even, clamped to [-128, 127],
// times s), in one pass instead of up to six ATen operators.  Each step is the IEEE float32 operation
// torch performs, in the same order, so the result is torch's bits (checked per projection at load:
// model.Projection._fused_input_agrees); a NaN stays NaN, as through torch's clamp.

// float32 (|q| <= 448) -> the float32 value of its float8_e4m3fn rounding (nearest even): 3 mantissa bits
// for normal values (>= 2^-6), multiples of 2^-9 below (e4m3's subnormals); kernels.cpp's round_to_e4m3
inline __m256 round_to_e4m3(__m256 q) {
  const __m256i u = _mm256_castps_si256(q);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFFF))),
                                          _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 a = _mm256_castsi256_ps(_mm256_andnot_si256(sign, u));
  const __m256 big = _mm256_set1_ps(16384.0f);  // ulp 2^-9 just above it
  const __m256i sub = _mm256_or_si256(sign, _mm256_castps_si256(_mm256_sub_ps(_mm256_add_ps(a, big), big)));
  const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), small);
}

constexpr int64_t kActNone = 0, kActFp8 = 1, kActInt8 = 2;  // kernels.ACT_KINDS

inline __m256 quantize8(__m256 v, const float* pqs, int64_t act_kind, __m256 s) {
  if (pqs != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(pqs));
  if (act_kind == kActFp8) {
    // max(lo, q) / min(hi, q) return q when it is NaN (the second operand), as torch's clamp keeps it
    const __m256 q = _mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(-448.0f), _mm256_div_ps(v, s)));
    v = _mm256_mul_ps(round_to_e4m3(q), s);
  } else if (act_kind == kActInt8) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-128.0f), q));
    v = _mm256_mul_ps(q, s);
  }
  return v;
}

// x [M, K] float32 (K a multiple of 8); pre_quant_scale [K] float32 or None; act_kind kActNone / kActFp8 /
// kActInt8 with its scale
at::Tensor quantize_input(const at::Tensor& x, const c10::optional<at::Tensor>& pre_quant_scale, int64_t act_kind,
                          double act_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 8 == 0,
              "rtk_avx2.quantize_input: x is [M, K] float32, K a multiple of 8");
  TORCH_CHECK(act_kind >= kActNone && act_kind <= kActInt8, "rtk_avx2.quantize_input: act_kind is 0, 1 or 2");
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor pq;
  if (pre_quant_scale.has_value()) {
    pq = pre_quant_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(pq.numel() == k, "rtk_avx2.quantize_input: pre_quant_scale has in_features values");
  }
  at::Tensor y = at::empty_like(xc);
  const float* xs = xc.data_ptr<float>();
  const float* ps = pq.defined() ? pq.data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const __m256 s = _mm256_set1_ps(static_cast<float>(act_scale));
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < k; c += 8)
        _mm256_storeu_ps(ys + r * k + c, quantize8(_mm256_loadu_ps(xs + r * k + c), ps ? ps + c : nullptr, act_kind, s));
  });
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

// The four u8 x s8 products of each 32-bit lane added to that lane of acc.  With AVX512-VNNI (and VL: Intel
// Ice Lake / Cascade Lake and later, AMD Zen 4 and later) one vpdpbusd; otherwise vpmaddubsw + vpmaddwd +
// vpaddd.  The same integers either way wherever vpmaddubsw's int16 pair sums do not saturate, which every
// caller guarantees (|a| <= 128 and |b| <= 127, or a nibble and a code), so the two builds of this file give
// the same bits (kernels_avx2.py builds it twice: rtk_avx2 and, where the CPU has VNNI, rtk_vnni).
inline __m256i dot4_add(__m256i acc, __m256i a_u8, __m256i b_s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a_u8, b_s8);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a_u8, b_s8), _mm256_set1_epi16(1)));
#endif
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// y[r * ldy + o] = float(sum_k q[r, k] * w_o[k]) * oscale[o] for R rows and O (1 or 2) outputs, whose
// codes are O-interleaved: the 32 codes of output o from k on are at w + O * k + 32 * o, so that the
// codes stream as one sequence (measured against the export's row order, which took two outputs from
// 3 rows up and one below: 22 % faster at 3-4 rows, 5-8 % at 1-2 and 8 rows).
//
// Blockwise (w8a8_blockwise): each row's input has a scale per block of 32 (qs [R, K / 32]), as llama.cpp's
// Q8_0 activations do; a block's exact integer sum (< 2^24, so exact in float32 too) is scaled by its
// block's scale and added in float32, in the same order for every row.
template <int64_t R, int64_t O, bool Blockwise>
inline void idot(const int8_t* q, const uint8_t* qa, const float* qs, int64_t K, const int8_t* w,
                 const float* oscale, float* y, int64_t ldy) {
  __m256i acc[R][O];
  __m256 facc[R][O];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) {
      acc[r][o] = _mm256_setzero_si256();
      facc[r][o] = _mm256_setzero_ps();
    }
  const int64_t nb = K / 32;
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wv[O];
    for (int64_t o = 0; o < O; ++o) {  // the codes 2 KiB ahead: the hardware prefetcher alone fell behind
      _mm_prefetch(reinterpret_cast<const char*>(w + O * k + 32 * o + 2048), _MM_HINT_T0);
      wv[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + O * k + 32 * o));
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + r * K + k));
      for (int64_t o = 0; o < O; ++o) {
        const __m256i signed_codes = _mm256_sign_epi8(wv[o], qv);
        if constexpr (Blockwise) {
          const __m256i sums = dot4_add(_mm256_setzero_si256(), av, signed_codes);
          const __m256 block_scale = _mm256_set1_ps(qs[r * nb + k / 32]);
          facc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), block_scale, facc[r][o]);
        } else {
          // not dot4_add(acc, ...): a decode row's one or two accumulators would carry vpdpbusd's 5-cycle
          // latency from step to step; summed apart, only the 1-cycle vpaddd is chained
          acc[r][o] = _mm256_add_epi32(acc[r][o], dot4_add(_mm256_setzero_si256(), av, signed_codes));
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) {
      const float sum = Blockwise ? hsum(facc[r][o], _mm256_setzero_ps()) : static_cast<float>(hsum_i32(acc[r][o]));
      y[r * ldy + o] = sum * oscale[o];
    }
}

template <int64_t O, bool Blockwise>
inline void idot_rows(const int8_t* q, const uint8_t* qa, const float* qs, int64_t rows, int64_t K, const int8_t* w,
                      const float* oscale, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  by_row_tiles(rows, [&](auto R, int64_t r) {
    idot<decltype(R)::value, O, Blockwise>(q + r * K, qa + r * K, qs + r * nb, K, w, oscale, y + r * ldy, ldy);
  });
}

// 32 float32 inputs -> int8 codes round(x / s) clamped to -128..127 (float32 division, round half to
// even, as checkpoint.fake_quant), and their absolute values where qa is given; with ``pqs`` (the SmoothQuant / AWQ
// pre_quant_scale of these 32 inputs) round((x * pqs) / s), the product rounded to float32 first, as
// torch's multiplication before the quantization rounds it
inline void quantize_block(const float* x, __m256 sv, int8_t* q, uint8_t* qa, const float* pqs = nullptr) {
  const __m256 lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    __m256 v = _mm256_loadu_ps(x + j * 8);
    if (pqs != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(pqs + j * 8));
    v = _mm256_div_ps(v, sv);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
  }
  const __m256i c8 = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), c8);
  if (qa != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa), _mm256_abs_epi8(c8));
}

// Every output pair (and an odd N's last output) of R rows, row tiles innermost.
template <bool Blockwise>
void idot_all(const std::vector<int8_t>& q, const std::vector<uint8_t>& qa, const float* qs, int64_t rows,
              int64_t K, const int8_t* w, const float* os, int64_t n, float* yp);

constexpr int64_t kRowTile = 16;  // rows whose quantized inputs stay in L1 while a thread's outputs pass

// x [R, K] float32 (the projection's input before its quantization, and before its pre_quant_scale [K]
// float32 where given); codes: N x K int8 in -127..127, pair-interleaved (kernels_avx2.W8A8Weight.pack:
// outputs 2p and 2p + 1 alternate in blocks of 32 codes; an odd N's last output follows as it is);
// oscale [N] float32 = act_scale * weight scale[o].
//
// Calls of at least kGemmRows rows with ``plain`` (the same codes [N, K] in the export's order) take oneDNN's int8
// GEMM instead (at::_int_mm: AVX512-VNNI kernels, blocked for many rows): the same integer sums, exact in any
// order, converted and scaled as here, so the same bits; 2-6x faster than idot from 6 to 64 rows on an Ice Lake
// host (docs/engine-measurements.md, "oneDNN's int8 GEMM for prompt rows").  kernels_avx2.W8A8Weight gives ``plain``
// only on the VNNI build's hosts, where it was measured.
constexpr int64_t kGemmRows = 6;

at::Tensor w8a8(const at::Tensor& x, double act_scale, const at::Tensor& codes, const at::Tensor& oscale,
                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& pre_quant_scale,
                const c10::optional<at::Tensor>& plain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.w8a8: x must be [rows, K] float32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "rtk_avx2.w8a8: codes must be [N, K] int8, contiguous");
  const int64_t rows = x.size(0), K = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "rtk_avx2.w8a8: K must match the codes and be a multiple of 32");
  TORCH_CHECK(oscale.scalar_type() == at::kFloat && oscale.numel() == n && oscale.is_contiguous(),
              "rtk_avx2.w8a8: oscale must be [N] float32");
  at::Tensor pqs;
  if (pre_quant_scale.has_value()) {
    pqs = pre_quant_scale->contiguous();
    TORCH_CHECK(pqs.scalar_type() == at::kFloat && pqs.numel() == K,
                "rtk_avx2.w8a8: pre_quant_scale must be [K] float32");
  }
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // the input's codes, as checkpoint.fake_quant computes them (float32 division, round half to even,
  // clamp); a NaN input has no integer code (it gives -128 here, NaN on the dense path)
  const bool gemm = plain.has_value() && rows >= kGemmRows;
  std::vector<int8_t> q(rows * K);
  std::vector<uint8_t> qa(gemm ? 0 : rows * K);  // idot's (the GEMM takes the signed codes)
  const float* xp = xs.data_ptr<float>();
  const float* pp = pqs.defined() ? pqs.data_ptr<float>() : nullptr;
  const __m256 sv = _mm256_set1_ps(static_cast<float>(act_scale));
  const int64_t nb = K / 32;
  at::parallel_for(0, rows * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block(xp + b * 32, sv, q.data() + b * 32, gemm ? nullptr : qa.data() + b * 32,
                     pp ? pp + b % nb * 32 : nullptr);
  });
  if (gemm) {
    TORCH_CHECK(plain->scalar_type() == at::kChar && plain->dim() == 2 && plain->size(0) == n && plain->size(1) == K,
                "rtk_avx2.w8a8: plain must be the [N, K] int8 codes");
    const at::Tensor sums = at::_int_mm(at::from_blob(q.data(), {rows, K}, at::kChar), plain->t());
    y.copy_(sums);  // int32 -> float32, rounded to nearest even as static_cast rounds idot's sums
    y.mul_(oscale);
  } else {
    idot_all<false>(q, qa, nullptr, rows, K, codes.data_ptr<int8_t>(), oscale.data_ptr<float>(), n,
                    y.data_ptr<float>());
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

// -- The VNNI build's 512-bit tiles for many rows (blockwise W8A8 here, W4A8 below) --------------------
//
// Prompt rows are bound by instructions, not by the weights' bytes, and idot spends four on every 32
// products of a row and an output (vpsignb, vpdpbusd, the conversion, the multiply-add).  Here one 512-bit
// register holds an output pair's two accumulators side by side (lanes 0-7 output 2p, 8-15 output 2p + 1),
// fed by one load of the pair's interleaved codes, the row's block broadcast to both halves and its scale to
// all 16 lanes: each half does, lane for lane, what idot does in its 256-bit register (the same integer lane
// sums, conversions, multiply-adds in the same order, the same final sum), so the same bits with half the
// instructions.  vpsignb has no 512-bit form: the input goes in as the unsigned q + 128, and each lane starts
// from -128 * (its four codes' sum) (computed once a block for all the tile's rows), so that vpdpbusd leaves
// exactly sum q * code, the integer idot's lanes hold.
#ifdef RTK_WIDE_TILES  // kWideRows, low_half, high_half: with dot_wide above
constexpr int64_t kWidePairs = 4;  // output pairs a tile: 16 accumulators of the 32 registers

inline __m512i broadcast32(const int8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows (qs their block scales) by P output pairs whose codes start at w, pair_bytes apart.
template <int64_t R, int64_t P>
inline void idot_wide(const int8_t* q, const float* qs, int64_t K, const int8_t* w, int64_t pair_bytes,
                      const float* oscale, float* y, int64_t ldy) {
  __m512 facc[R][P];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) facc[r][p] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512(), offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t nb = K / 32;
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[P], start[P];
    for (int64_t p = 0; p < P; ++p) {  // the codes 2 KiB ahead, as idot (a weight larger than the caches)
      _mm_prefetch(reinterpret_cast<const char*>(w + p * pair_bytes + 2 * k + 2048), _MM_HINT_T0);
      wv[p] = _mm512_loadu_si512(w + p * pair_bytes + 2 * k);
      start[p] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, wv[p]));
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512i u = _mm512_xor_si512(broadcast32(q + r * K + k), offset);
      const __m512 s = _mm512_set1_ps(qs[r * nb + k / 32]);
      for (int64_t p = 0; p < P; ++p)
        facc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start[p], u, wv[p])), s, facc[r][p]);
    }
  }
  const __m256 z = _mm256_setzero_ps();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) {
      y[r * ldy + 2 * p] = hsum(low_half(facc[r][p]), z) * oscale[2 * p];
      y[r * ldy + 2 * p + 1] = hsum(high_half(facc[r][p]), z) * oscale[2 * p + 1];
    }
}

// rows (any number) by P pairs, four rows at a time
template <int64_t P>
inline void idot_wide_rows(const int8_t* q, const float* qs, int64_t rows, int64_t K, const int8_t* w,
                           const float* oscale, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  by_row_tiles(rows, [&](auto R, int64_t r) {
    idot_wide<decltype(R)::value, P>(q + r * K, qs + r * nb, K, w, 2 * K, oscale, y + r * ldy, ldy);
  });
}
#endif

template <bool Blockwise>
void idot_all(const std::vector<int8_t>& q, const std::vector<uint8_t>& qa, const float* qs, int64_t rows,
              int64_t K, const int8_t* w, const float* os, int64_t n, float* yp) {
  const int64_t pairs = n / 2, nb = K / 32;
  at::parallel_for(0, pairs + n % 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t rt = std::min(kRowTile, rows - r0);
      const int8_t* qr = q.data() + r0 * K;
      const uint8_t* ar = qa.data() + r0 * K;
      const float* sr = qs == nullptr ? nullptr : qs + r0 * nb;
      int64_t p = p0;
#ifdef RTK_WIDE_TILES
      if (Blockwise && rows >= kWideRows) {
        for (; p + kWidePairs <= std::min(p1, pairs); p += kWidePairs)
          idot_wide_rows<kWidePairs>(qr, sr, rt, K, w + 2 * p * K, os + 2 * p, yp + r0 * n + 2 * p, n);
        for (; p < std::min(p1, pairs); ++p)
          idot_wide_rows<1>(qr, sr, rt, K, w + 2 * p * K, os + 2 * p, yp + r0 * n + 2 * p, n);
      }
#endif
      for (; p < std::min(p1, pairs); ++p)  // two outputs share each input load
        idot_rows<2, Blockwise>(qr, ar, sr, rt, K, w + 2 * p * K, os + 2 * p, yp + r0 * n + 2 * p, n);
      if (p1 > pairs)  // an odd N's last output
        idot_rows<1, Blockwise>(qr, ar, sr, rt, K, w + (n - 1) * K, os + n - 1, yp + r0 * n + n - 1, n);
    }
  });
}

// max |x| of 32 floats: per lane, then across lanes (a maximum is exact in any order).  _mm256_max_ps(v, m)
// is v > m ? v : m, so a NaN input never wins, as with std::max(m, fabs(v)) one at a time.
inline float block_amax(const float* x) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + 8 * j), magnitude), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// A projection's float32 inputs quantized per row and block of 32 as llama.cpp's Q8_0 activations: scale =
// max |x| / 127 of the block (a block of zeros has codes 0 and scale 0), codes round(x / scale).
struct BlockInputs {
  std::vector<int8_t> q;
  std::vector<uint8_t> qa;  // |q|, for idot's vpsignb products (abs_codes); W4A8 has none
  std::vector<float> qs;

  // pre_scale [K] (AWQ's pre_quant_scale), where given: the inputs are x * pre_scale, each product one float32
  // rounding as torch's elementwise product, made here block by block instead of in a tensor of its own.
  BlockInputs(const float* xp, int64_t rows, int64_t K, bool abs_codes, const float* pre_scale = nullptr)
      : q(rows * K), qa(abs_codes ? rows * K : 0), qs(rows * K / 32) {
    at::parallel_for(0, rows * K / 32, 64, [&](int64_t b0, int64_t b1) {
      alignas(32) float scaled[32];
      for (int64_t b = b0; b < b1; ++b) {
        const float* x = xp + b * 32;
        if (pre_scale != nullptr) {
          const float* ps = pre_scale + (b % (K / 32)) * 32;
          for (int j = 0; j < 32; j += 8)
            _mm256_store_ps(scaled + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(ps + j)));
          x = scaled;
        }
        const float amax = block_amax(x);
        qs[b] = amax / 127.0f;
        // a zero block: any nonzero divisor gives codes 0 and its scale 0 keeps its sums out
        quantize_block(x, _mm256_set1_ps(amax > 0.0f ? qs[b] : 1.0f), q.data() + b * 32,
                       abs_codes ? qa.data() + b * 32 : nullptr);
      }
    });
  }
};

// A weight-only INT8 projection (W8A16) with its inputs quantized here (BlockInputs).  Not the export's
// arithmetic (float inputs): kernels_avx2.W8A8Weight states what it costs.  x [R, K] float32; codes and
// oscale as w8a8's, oscale [N] = the weights' scales.
// pre_scale: see BlockInputs (Projection32 passes AWQ's pre_quant_scale; the op, none).
at::Tensor w8a8_blockwise_scaled(const at::Tensor& x, const float* pre_scale, const at::Tensor& codes,
                                 const at::Tensor& oscale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.w8a8_blockwise: x must be [rows, K] float32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "rtk_avx2.w8a8_blockwise: codes must be [N, K] int8, contiguous");
  const int64_t rows = x.size(0), K = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0,
              "rtk_avx2.w8a8_blockwise: K must match the codes and be a multiple of 32");
  TORCH_CHECK(oscale.scalar_type() == at::kFloat && oscale.numel() == n && oscale.is_contiguous(),
              "rtk_avx2.w8a8_blockwise: oscale must be [N] float32");
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const BlockInputs in(xs.data_ptr<float>(), rows, K, true, pre_scale);
  idot_all<true>(in.q, in.qa, in.qs.data(), rows, K, codes.data_ptr<int8_t>(), oscale.data_ptr<float>(), n,
                 y.data_ptr<float>());
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

at::Tensor w8a8_blockwise(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& oscale,
                          const c10::optional<at::Tensor>& bias) {
  return w8a8_blockwise_scaled(x, nullptr, codes, oscale, bias);
}

// -- W4A8: INT4 weights (AWQ, W4A16 exports) as integer products -------------------------------------
//
// What llama.cpp's Q4_0 x Q8_0 dot product computes on AVX2 (ggml-org/llama.cpp ggml/src/ggml-cpu/arch/x86/
// quants.c, ggml_vec_dot_q4_0_q8_0, which subtracts 8 from each code and multiplies with vpsignb), with
// AWQ's groups: the inputs quantized per block of 32 (BlockInputs), each block's 32 products summed as
// integers, times the input block's scale and summed in float32 within a weight group, and each group's
// sum times the group's scale into the output's float32 total.  Codes -8..7 are stored as nibbles
// n = code + 8: an output's 64 inputs from k on are 32 bytes, byte j holding input k + j's nibble (low)
// and input k + 32 + j's (high), so one load, a shift and two masks give two blocks' codes in the inputs'
// order; outputs 2p and 2p + 1 alternate 32 bytes by 32 bytes (kernels_avx2.W4A8Weight.pack), so the two
// outputs computed together stream as one sequence.  vpmaddubsw multiplies the unsigned nibbles by the
// signed input codes (pairs within 2 * 15 * 127), and sum (n - 8) q = sum n q - 8 sum q: the second
// term is the row's alone, summed per group once a call (group_corrections) and taken off each group's
// sum.  The order of every sum is fixed per row, so a row's outputs depend on that row alone.

// corr[r * G + g] = sum over group g's blocks of 8 * (sum of the block's codes) * block scale
std::vector<float> group_corrections(const BlockInputs& in, int64_t rows, int64_t K, int64_t G) {
  const int64_t nb = K / 32, per_group = nb / G;
  std::vector<float> corr(rows * G);
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float c = 0.0f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {  // the block's exact sum of codes
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q.data() + r * K + b * 32));
          const int32_t sum = hsum_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16));
          c += static_cast<float>(8 * sum) * in.qs[r * nb + b];
        }
        corr[r * G + g] = c;
      }
  });
  return corr;
}

// y[r * ldy + o] for R rows and O (1 or 2) outputs; gs: the O outputs' group scales, gs[o * G + g].
// OneChunk: groups of 64 inputs (one chunk each), whose two blocks' sum goes straight into the total.
template <int64_t R, int64_t O, bool OneChunk>
inline void idot4(const int8_t* q, const float* qs, const float* corr, int64_t K, const uint8_t* w, const float* gs,
                  int64_t G, float* y, int64_t ldy) {
  __m256 total[R][O];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) total[r][o] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t nb = K / 32, chunks_per_group = OneChunk ? 1 : nb / G / 2;
  for (int64_t g = 0; g < G; ++g) {
    __m256 group[R][O];
    if constexpr (!OneChunk)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t o = 0; o < O; ++o) group[r][o] = _mm256_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      __m256i n0[O], n1[O];
      for (int64_t o = 0; o < O; ++o) {
        const uint8_t* wc = w + O * 32 * c + 32 * o;
        _mm_prefetch(reinterpret_cast<const char*>(wc + 2048), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc));
        n0[o] = _mm256_and_si256(raw, low);
        n1[o] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* qc = q + r * K + 64 * c;
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + 32));
        const __m256 s0 = _mm256_set1_ps(qs[r * nb + 2 * c]), s1 = _mm256_set1_ps(qs[r * nb + 2 * c + 1]);
        for (int64_t o = 0; o < O; ++o) {
          const __m256i d0 = dot4_add(_mm256_setzero_si256(), n0[o], q0);
          const __m256i d1 = dot4_add(_mm256_setzero_si256(), n1[o], q1);
          if constexpr (OneChunk) {
            const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s1, _mm256_mul_ps(_mm256_cvtepi32_ps(d0), s0));
            const __m256 off = _mm256_setr_ps(corr[r * G + g], 0, 0, 0, 0, 0, 0, 0);
            total[r][o] = _mm256_fmadd_ps(_mm256_sub_ps(sum, off), _mm256_set1_ps(gs[o * G + g]), total[r][o]);
          } else {
            group[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s0, group[r][o]);
            group[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s1, group[r][o]);
          }
        }
      }
    }
    if constexpr (!OneChunk)
      for (int64_t r = 0; r < R; ++r) {
        const __m256 off = _mm256_setr_ps(corr[r * G + g], 0, 0, 0, 0, 0, 0, 0);
        for (int64_t o = 0; o < O; ++o)
          total[r][o] = _mm256_fmadd_ps(_mm256_sub_ps(group[r][o], off), _mm256_set1_ps(gs[o * G + g]), total[r][o]);
      }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) y[r * ldy + o] = hsum(total[r][o], _mm256_setzero_ps());
}

#ifdef RTK_WIDE_TILES
// idot4's arithmetic for R rows by P output pairs, two outputs a 512-bit register as idot_wide: one load of a
// pair's chunk gives both outputs' nibbles, and each half does lane for lane what idot4 does (the same bits).
template <int64_t R, int64_t P, bool OneChunk>
inline void idot4_wide(const int8_t* q, const float* qs, const float* corr, int64_t K, const uint8_t* w,
                       const float* gs, int64_t G, float* y, int64_t ldy) {
  __m512 total[R][P];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) total[r][p] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const int64_t nb = K / 32, chunks_per_group = OneChunk ? 1 : nb / G / 2;
  for (int64_t g = 0; g < G; ++g) {
    __m512 group_scale[P], group[R][P];
    for (int64_t p = 0; p < P; ++p)  // lanes 0-7 output 2p's group scale, 8-15 output 2p + 1's
      group_scale[p] =
          _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(gs[2 * p * G + g]), _mm512_set1_ps(gs[(2 * p + 1) * G + g]));
    if constexpr (!OneChunk)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t p = 0; p < P; ++p) group[r][p] = _mm512_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      __m512i n0[P], n1[P];
      for (int64_t p = 0; p < P; ++p) {  // a pair's K / 2 bytes each, 64 a chunk
        _mm_prefetch(reinterpret_cast<const char*>(w + p * K + 64 * c + 2048), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(w + p * K + 64 * c);
        n0[p] = _mm512_and_si512(raw, low);
        n1[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m512i q0 = broadcast32(q + r * K + 64 * c), q1 = broadcast32(q + r * K + 64 * c + 32);
        const __m512 s0 = _mm512_set1_ps(qs[r * nb + 2 * c]), s1 = _mm512_set1_ps(qs[r * nb + 2 * c + 1]);
        const __m512 off = _mm512_maskz_mov_ps(0x0101, _mm512_set1_ps(corr[r * G + g]));
        for (int64_t p = 0; p < P; ++p) {
          const __m512i d0 = _mm512_dpbusd_epi32(zero, n0[p], q0);
          const __m512i d1 = _mm512_dpbusd_epi32(zero, n1[p], q1);
          if constexpr (OneChunk) {
            const __m512 sum =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s1, _mm512_mul_ps(_mm512_cvtepi32_ps(d0), s0));
            total[r][p] = _mm512_fmadd_ps(_mm512_sub_ps(sum, off), group_scale[p], total[r][p]);
          } else {
            group[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, group[r][p]);
            group[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s1, group[r][p]);
          }
        }
      }
    }
    if constexpr (!OneChunk)
      for (int64_t r = 0; r < R; ++r) {
        const __m512 off = _mm512_maskz_mov_ps(0x0101, _mm512_set1_ps(corr[r * G + g]));
        for (int64_t p = 0; p < P; ++p)
          total[r][p] = _mm512_fmadd_ps(_mm512_sub_ps(group[r][p], off), group_scale[p], total[r][p]);
      }
  }
  const __m256 z = _mm256_setzero_ps();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < P; ++p) {
      y[r * ldy + 2 * p] = hsum(low_half(total[r][p]), z);
      y[r * ldy + 2 * p + 1] = hsum(high_half(total[r][p]), z);
    }
}

#endif

// A call's rows (by_row_tiles) through idot4<R, O, OneChunk>, or with Wide idot4_wide<R, O, OneChunk> (O output pairs)
template <bool Wide, int64_t O, bool OneChunk>
inline void idot4_rows(const int8_t* q, const float* qs, const float* corr, int64_t rows, int64_t K,
                       const uint8_t* w, const float* gs, int64_t G, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  by_row_tiles(rows, [&](auto R, int64_t r) {
    constexpr int64_t Rows = decltype(R)::value;
#ifdef RTK_WIDE_TILES
    if constexpr (Wide)
      idot4_wide<Rows, O, OneChunk>(q + r * K, qs + r * nb, corr + r * G, K, w, gs, G, y + r * ldy, ldy);
    else
#else
    static_assert(!Wide, "idot4_rows: the wide tiles are in the VNNI build only");
#endif
      idot4<Rows, O, OneChunk>(q + r * K, qs + r * nb, corr + r * G, K, w, gs, G, y + r * ldy, ldy);
  });
}

// x [R, K] float32, times pre_scale [K] where given (AWQ's pre_quant_scale, BlockInputs); codes [N, K / 2] uint8
// as described above; scales [N, G] float32, G dividing K into groups of a multiple of 64 inputs.
at::Tensor w4a8_scaled(const at::Tensor& x, const float* pre_scale, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rtk_avx2.w4a8: x must be [rows, K] float32");
  const int64_t rows = x.size(0), K = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte && K % 64 == 0 &&
                  codes.size(1) * 2 == K,
              "rtk_avx2.w4a8: codes must be [N, K / 2] uint8, contiguous, K a multiple of 64");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == n &&
                  scales.is_contiguous() && (K / 64) % scales.size(1) == 0,
              "rtk_avx2.w4a8: scales must be [N, G] float32, groups of a multiple of 64 inputs");
  const int64_t G = scales.size(1), pairs = n / 2, half = K / 2, nb = K / 32;
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const BlockInputs in(xs.data_ptr<float>(), rows, K, false, pre_scale);
  const std::vector<float> corr = group_corrections(in, rows, K, G);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const float* gs = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // each weight group one chunk of 64 inputs (K == 64 G) or several: chosen once a call
  const auto by_pairs = [&](auto one_chunk) {
    constexpr bool OneChunk = decltype(one_chunk)::value;
    at::parallel_for(0, pairs + n % 2, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t rt = std::min(kRowTile, rows - r0);
        const int8_t* qr = in.q.data() + r0 * K;
        const float* sr = in.qs.data() + r0 * nb;
        const float* cr = corr.data() + r0 * G;
        float* yr = yp + r0 * n;
        int64_t p = p0;
#ifdef RTK_WIDE_TILES
        if (rows >= kWideRows) {
          const int64_t pe = std::min(p1, pairs);
          // one chunk a group: 4 pairs a tile; otherwise the group sums take registers too
          constexpr int64_t P = OneChunk ? 4 : 2;
          for (; p + P <= pe; p += P)
            idot4_rows<true, P, OneChunk>(qr, sr, cr, rt, K, w + 2 * p * half, gs + 2 * p * G, G, yr + 2 * p, n);
          for (; p < pe; ++p)
            idot4_rows<true, 1, OneChunk>(qr, sr, cr, rt, K, w + 2 * p * half, gs + 2 * p * G, G, yr + 2 * p, n);
        }
#endif
        for (; p < std::min(p1, pairs); ++p)
          idot4_rows<false, 2, OneChunk>(qr, sr, cr, rt, K, w + 2 * p * half, gs + 2 * p * G, G, yr + 2 * p, n);
        if (p1 > pairs)
          idot4_rows<false, 1, OneChunk>(qr, sr, cr, rt, K, w + (n - 1) * half, gs + (n - 1) * G, G, yr + n - 1, n);
      }
    });
  };
  if (K == 64 * G)
    by_pairs(std::true_type{});
  else
    by_pairs(std::false_type{});
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

at::Tensor w4a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias) {
  return w4a8_scaled(x, nullptr, codes, scales, bias);
}

// -- W4A8 rows with outputs in the lanes (AVX512-VNNI) ----------------------------------------------
//
// w4a8_tiles' arithmetic (below) for every row where AMX is absent (AMD Zen 4, Intel Ice Lake;
// kernels_avx2.W4A8Weight.lanes): the same codes layout
// (pack_tiles), the same integer block sums and float32 operations in the same order, so the same bits.  A
// 512-bit register holds 16 outputs' sums; a block's 32 inputs are 8 vpdpbusd of the unpacked nibbles
// (output o's inputs 4 kk .. 4 kk + 3 in lane o, tdpbssd's B tile) by the row's 4 input codes broadcast to every
// lane, each register's sums started at -8 * (the block's input codes' sum), so that they end as sum (n - 8) q,
// the signed products the tiles sum.  Then one conversion and one multiply-add a block, row and 16 outputs, where
// w4a8's lanes (an output pair a register) take 16.  A row tile (by_lane_tiles) shares each block's unpacked codes.

// The shapes w4a8_lanes and w4a8_tiles take, checked: x [rows, K] float32, codes [N / 16, K / 32, 256] uint8
// (kernels_avx2.pack_tiles), scales [N / 16, G, 16] float32 (kernels_avx2.pack_tile_scales: a tile's 16 outputs'
// scales per group, one load each), G dividing K's blocks of 32.
struct TileCall {
  int64_t rows, K, nb, n, G;
  const uint8_t* w;   // the codes
  const float* gs;    // the scales, tile t's at gs + t * G * 16
  TileCall(const char* who, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, who, ": x must be [rows, K] float32");
    rows = x.size(0), K = x.size(1), nb = K / 32;
    TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == at::kByte && K % 32 == 0 &&
                    codes.size(1) == nb && codes.size(2) == 256,
                who, ": codes must be [N / 16, K / 32, 256] uint8, contiguous (kernels_avx2.pack_tiles)");
    n = codes.size(0) * 16;
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == codes.size(0) &&
                    scales.size(2) == 16 && scales.is_contiguous() && scales.size(1) > 0 && nb % scales.size(1) == 0,
                who, ": scales must be [N / 16, G, 16] float32, contiguous (kernels_avx2.pack_tile_scales), "
                "groups of a multiple of 32 inputs");
    G = scales.size(1);
    w = codes.data_ptr<uint8_t>();
    gs = scales.data_ptr<float>();
  }
};

#ifdef RTK_WIDE_TILES
// A call of at most this many rows is one row tile, each block unpacked into registers: 0.66-0.79x the time of two
// row tiles over a buffer at 5-7 rows (SmolLM2's INT4 projections, AMD Zen 4); at 8 the rows' sums no longer fit
// the registers beside the codes.
constexpr int64_t kLanePacked = 7;
static_assert(kLanePacked >= kRowBlock, "by_lane_tiles: calls of up to kRowBlock rows are one tile too");

// tile(R, r) as by_row_tiles, but a call of at most kLanePacked rows as one tile of all its rows
template <typename Tile>
inline void by_lane_tiles(int64_t rows, Tile&& tile) {
  switch (rows) {
    case 7: tile(std::integral_constant<int64_t, 7>{}, 0); break;
    case 6: tile(std::integral_constant<int64_t, 6>{}, 0); break;
    case 5: tile(std::integral_constant<int64_t, 5>{}, 0); break;
    default: by_row_tiles(rows, tile);
  }
}

// R rows of one tile of 16 outputs: u the tile's unpacked codes (nb blocks x 8 registers of 64 bytes) or, with
// Packed, its codes as stored (each block unpacked into registers: a call of one row tile, where a buffer would be
// written and read once), q / qs / start the rows' input codes, block scales and -8 * block code sums, gs16 the 16
// outputs' scales per group; next, where not null, the codes (as stored) of the tile to unpack after this one,
// fetched into L2 block by block while this one's products run (w4a8_tiles does the same), so that its unpacking
// reads them from the cache instead of waiting on memory between two tiles' products: 0.74-0.80x the time of a
// call of 8-16 rows (L1 instead of L2: 0.86-0.90x; L1 keeps the unpacked codes and the rows' inputs).
// Not inlined: each (R, Packed) compiled as a function of its own keeps its sums in registers; inlined into
// w4a8_lanes' loop beside the other instantiations, GCC spilled them (7 packed rows took 1.7x the time, other row
// counts 1.0-1.1x).
template <int64_t R, bool Packed>
__attribute__((noinline)) void lanes_rows(const int8_t* q, const float* qs, const int32_t* start, int64_t K,
                                          const uint8_t* u, const float* gs16, int64_t G, float* y, int64_t ldy,
                                          const uint8_t* next = nullptr) {
  const int64_t nb = K / 32, per_group = nb / G;
  __m512 total[R];
  for (int64_t r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 group[R];
    for (int64_t h = 0; h < per_group; ++h) {
      const int64_t b = g * per_group + h;
      __m512i wv[8];
      if constexpr (Packed) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {  // the block's 64 bytes j: its rows kk = j (low nibbles) and j + 4 (high)
          _mm_prefetch(reinterpret_cast<const char*>(u + b * 256 + 64 * j + 2048), _MM_HINT_T0);  // as w4a8's
          const __m512i raw = _mm512_loadu_si512(u + b * 256 + 64 * j);
          wv[j] = _mm512_and_si512(raw, low);
          wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
      } else {
        for (int kk = 0; kk < 8; ++kk) wv[kk] = _mm512_load_si512(u + b * 512 + 64 * kk);
        if (next != nullptr)
          for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + b * 256 + 64 * j), _MM_HINT_T1);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* qb = reinterpret_cast<const int32_t*>(q + r * K + 32 * b);
        // two chains of 4 (the integer sums are exact in any order)
        __m512i s0 = _mm512_set1_epi32(start[r * nb + b]), s1 = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; kk += 2) {
          s0 = _mm512_dpbusd_epi32(s0, wv[kk], _mm512_set1_epi32(qb[kk]));
          s1 = _mm512_dpbusd_epi32(s1, wv[kk + 1], _mm512_set1_epi32(qb[kk + 1]));
        }
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        const __m512 scale = _mm512_set1_ps(qs[r * nb + b]);
        group[r] = h == 0 ? _mm512_mul_ps(sum, scale) : _mm512_fmadd_ps(sum, scale, group[r]);
      }
    }
    const __m512 gv = _mm512_loadu_ps(gs16 + g * 16);
    for (int64_t r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(group[r], gv, total[r]);
  }
  for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, total[r]);
}

at::Tensor w4a8_lanes_scaled(const at::Tensor& x, const float* pre_scale, const at::Tensor& codes,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  const TileCall call("rtk_vnni.w4a8_lanes", x, codes, scales);
  const int64_t rows = call.rows, K = call.K, nb = call.nb, n = call.n, G = call.G;
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const BlockInputs in(xs.data_ptr<float>(), rows, K, false, pre_scale);
  std::vector<int32_t> start(rows * nb);  // -8 * each block's sum of input codes
  for (int64_t i = 0; i < rows * nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += in.q[32 * i + j];
    start[i] = -8 * s;
  }
  const int8_t* q = in.q.data();
  const float* qs = in.qs.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / 16, 1, [&](int64_t t0, int64_t t1) {
    // the thread's buffer, kept from call to call: a tile's unpacked codes
    static thread_local std::vector<uint8_t> unpacked_buffer;
    unpacked_buffer.resize(std::max<size_t>(unpacked_buffer.size(), nb * 512 + 64));
    uint8_t* u = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked_buffer.data()) + 63) & ~uintptr_t(63));
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = call.w + t * nb * 256;
      const float* gs16 = call.gs + t * G * 16;
      const bool packed = rows <= kLanePacked;  // one row tile (by_lane_tiles)
      if (!packed)
        for (int64_t j = 0; j < nb * 4; ++j) {  // block j / 4's 64 bytes j % 4: its rows kk = j % 4 and j % 4 + 4
          const __m512i raw = _mm512_loadu_si512(wt + 64 * j);
          uint8_t* block = u + (j / 4) * 512 + 64 * (j % 4);
          _mm512_store_si512(block, _mm512_and_si512(raw, low));
          _mm512_store_si512(block + 256, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
      by_lane_tiles(rows, [&](auto R, int64_t r) {
        constexpr int64_t Rows = decltype(R)::value;
        const int8_t* qr = q + r * K;
        const float* sr = qs + r * nb;
        const int32_t* st = start.data() + r * nb;
        float* yr = yp + r * n + 16 * t;
        if (packed)
          lanes_rows<Rows, true>(qr, sr, st, K, wt, gs16, G, yr, n);
        else if constexpr (Rows <= kRowBlock)  // the first row tile fetches the next tile's codes
          lanes_rows<Rows, false>(qr, sr, st, K, u, gs16, G, yr, n, r == 0 && t + 1 < t1 ? wt + nb * 256 : nullptr);
      });
    }
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

at::Tensor w4a8_lanes(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  return w4a8_lanes_scaled(x, nullptr, codes, scales, bias);
}
#else
at::Tensor w4a8_lanes_scaled(const at::Tensor&, const float*, const at::Tensor&, const at::Tensor&,
                             const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "w4a8_lanes: the AVX2 build has no AVX512-VNNI lanes (kernels_avx2.VNNI_FLAGS)");
  return at::Tensor();
}
#endif

// -- W4A8 prompt rows in AMX tiles (Intel Sapphire Rapids and later) ---------------------------------
//
// w4a8's arithmetic for calls of many rows with AMX's int8 tile products: the inputs quantized per block of 32
// as w4a8 does (BlockInputs: the same codes and scales), each block's 32 products summed as integers by
// tdpbssd (exact, as w4a8's), and the float32 part per row and output in its own fixed order: a group's
// blocks' sums times their input scales added in block order, the group's sum times the weight group's scale
// added into the total in group order.  w4a8 converts each lane's 4-product sums to float32 separately
// (vpdpbusd lanes) where this converts the block's whole sum, so the two round apart in the last bits: prompt
// rows take this kernel and decode rows w4a8 (model.Projection, DecodeLayers), and each row's result depends on
// that row alone, as w4a8's does.  codes [N / 16, K / 32, 256] uint8 (kernels_avx2.pack_tiles): per 16 outputs
// and block, the 512 signed codes as tdpbssd's B tile reads them (byte 64 kk + 4 o + i: output o's input
// 4 kk + i) stored as nibbles code + 8, bytes j (low) and j + 256 (high) of the tile in byte j.  Each thread
// unpacks one tile of 16 outputs at a time (K / 2 bytes into K bytes) and runs every row tile over it.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
using rtk_amx::TileConfig;
using rtk_amx::tiles_permitted;

at::Tensor w4a8_tiles_scaled(const at::Tensor& x, const float* pre_scale, const at::Tensor& codes,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles_permitted(), "rtk_vnni.w4a8_tiles: the kernel may not use AMX here (arch_prctl refused)");
  const TileCall call("rtk_vnni.w4a8_tiles", x, codes, scales);
  const int64_t rows = call.rows, K = call.K, nb = call.nb, n = call.n, G = call.G, per_group = nb / G,
                tail = rows % 16;
  at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const BlockInputs in(xs.data_ptr<float>(), rows, K, false, pre_scale);
  const int8_t* q = in.q.data();
  const float* qs = in.qs.data();
  const uint8_t* w = call.w;
  const float* gs = call.gs;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / 16, 1, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;  // tiles 0 and 3: a block's sums (16 rows x 16 int32); 1 and 4: 16 rows' 32 input codes;
    for (int c : {0, 3}) cfg.rows[c] = 16, cfg.colsb[c] = 64;  // 2 and 5: the block's codes (tdpbssd's B)
    for (int a : {1, 4}) cfg.rows[a] = 16, cfg.colsb[a] = 32;
    for (int c : {2, 5}) cfg.rows[c] = 8, cfg.colsb[c] = 64;
    if (tail > 0) {  // 6 and 7: the sums and input codes of the call's last rows % 16 (sum_group's last tile)
      cfg.rows[6] = static_cast<uint8_t>(tail), cfg.colsb[6] = 64;
      cfg.rows[7] = static_cast<uint8_t>(tail), cfg.colsb[7] = 32;
    }
    _tile_loadconfig(&cfg);
    // the thread's buffers, kept from call to call: the tile's unpacked codes and two groups' block sums
    static thread_local std::vector<int8_t> unpacked_buffer;
    static thread_local std::vector<int32_t> sums_buffer;
    unpacked_buffer.resize(std::max<size_t>(unpacked_buffer.size(), nb * 512 + 64));
    sums_buffer.resize(std::max<size_t>(sums_buffer.size(), 2 * per_group * 256 + 16));
    int8_t* b = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(unpacked_buffer.data()) + 63) & ~uintptr_t(63));
    int32_t* sums = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(sums_buffer.data()) + 63) & ~uintptr_t(63));
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = w + t * nb * 256;
      // the next tile's codes, a group's blocks at a time while this tile's first rows are summed: the unpacking
      // reads them from memory, and with nothing ahead of it a fifth of the kernel's time was that read's wait
      const char* next = t + 1 < t1 ? reinterpret_cast<const char*>(wt + nb * 256) : nullptr;
      const float* group_scales = gs + t * G * 16;  // the tile's 16 outputs' scales per group (16 a group)
      for (int64_t j = 0; j < nb * 4; ++j) {  // block j / 4's 64 bytes j % 4 into both halves of its tile
        const __m512i raw = _mm512_loadu_si512(wt + 64 * j);
        int8_t* tile = b + (j / 4) * 512 + 64 * (j % 4);
        _mm512_store_si512(tile, _mm512_sub_epi8(_mm512_and_si512(raw, low), eight));
        _mm512_store_si512(tile + 256, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), eight));
      }
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t valid = std::min<int64_t>(16, rows - r0);  // the tile's rows of the call
        // group g's block sums into sums + (g % 2) * per_group * 256, blocks alternating between tiles 0 and 3,
        // issued before the previous group's float work so that the two overlap; a last tile of fewer than 16
        // rows through tiles 6 and 7, which load, multiply and store only those rows (the same integer sums; a
        // 3-row tile moves ~a fifth of a 16-row one's bytes)
        const auto sum_group = [&](int64_t g) {
          int32_t* out = sums + (g % 2) * per_group * 256;
          if (valid < 16) {
            for (int64_t h = 0; h < per_group; ++h) {
              const int64_t block = g * per_group + h;
              _tile_zero(6);
              _tile_loadd(7, q + r0 * K + 32 * block, K);
              if (h % 2 == 0) {
                _tile_loadd(2, b + block * 512, 64);
                _tile_dpbssd(6, 7, 2);
              } else {
                _tile_loadd(5, b + block * 512, 64);
                _tile_dpbssd(6, 7, 5);
              }
              _tile_stored(6, out + 256 * h, 64);
            }
            return;
          }
          for (int64_t h = 0; h < per_group; ++h) {
            const int64_t block = g * per_group + h;
            if (h % 2 == 0) {
              _tile_zero(0);
              _tile_loadd(1, q + r0 * K + 32 * block, K);
              _tile_loadd(2, b + block * 512, 64);
              _tile_dpbssd(0, 1, 2);
              _tile_stored(0, out + 256 * h, 64);
            } else {
              _tile_zero(3);
              _tile_loadd(4, q + r0 * K + 32 * block, K);
              _tile_loadd(5, b + block * 512, 64);
              _tile_dpbssd(3, 4, 5);
              _tile_stored(3, out + 256 * h, 64);
            }
          }
        };
        __m512 total[16];
        for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
        sum_group(0);
        for (int64_t g = 0; g < G; ++g) {
          if (g + 1 < G) sum_group(g + 1);
          if (next != nullptr && r0 == 0)
            for (int64_t l = 0; l < per_group * 256; l += 64) _mm_prefetch(next + g * per_group * 256 + l, _MM_HINT_T0);
          const int32_t* group_sums = sums + (g % 2) * per_group * 256;
          const __m512 gv = _mm512_loadu_ps(group_scales + g * 16);
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            if (r >= valid) continue;  // past the call's rows: no float work
            const float* s = qs + (r0 + r) * nb + g * per_group;
            __m512 group = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(group_sums + 16 * r)), _mm512_set1_ps(s[0]));
            for (int64_t h = 1; h < per_group; ++h)
              group = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(group_sums + 256 * h + 16 * r)),
                                      _mm512_set1_ps(s[h]), group);
            total[r] = _mm512_fmadd_ps(group, gv, total[r]);
          }
        }
        for (int r = 0; r < valid; ++r) _mm512_storeu_ps(yp + (r0 + r) * n + 16 * t, total[r]);
      }
    }
    _tile_release();
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

at::Tensor w4a8_tiles(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  return w4a8_tiles_scaled(x, nullptr, codes, scales, bias);
}

bool tiles_available() { return tiles_permitted(); }
#else
at::Tensor w4a8_tiles_scaled(const at::Tensor&, const float*, const at::Tensor&, const at::Tensor&,
                             const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "w4a8_tiles: this build has no AMX tiles (kernels_avx2.VNNI_FLAGS)");
  return at::Tensor();
}

at::Tensor w4a8_tiles(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "w4a8_tiles: this build has no AMX tiles (kernels_avx2.VNNI_FLAGS)");
  return at::Tensor();
}
bool tiles_available() { return false; }
#endif

// -- Decode attention over the float32 paged pool (decode_attention.h) -----------------------------

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds, double scale) {
  return rtk_attention::decode_attention("rtk_avx2.decode_attention", q, k_pool, v_pool, ctx_slots, ctx_bounds, scale);
}

// -- DecodeLayers: a float32 engine's decode rows through whole decoder layers in one call ---------
//
// Between its projections a decode step runs ~30 small torch operators per layer (RMSNorm, RoPE, K/V
// writes, attention, residual adds, SiLU), most of each one's cost being Python and dispatch: about
// two thirds of a SmolLM2 batch-1 step on an AVX2 host.  Here the projections are the kernels above,
// called as model.Projection calls them for decode rows (with the input's pre_quant_scale and
// quantize-dequantize as ATen operators, in checkpoint.fake_quant's order); RoPE, the residual adds,
// the K/V writes and SiLU's product are loops of single float32 operations (this file is compiled with
// -ffp-contract=off, so a * b + c is never fused into one rounding); RMSNorm and SiLU call the ATen
// operators model.py calls, attention is decode_attention's, as model.py's for a float32 pool.  So the
// results are the operator path's bits
// (tests/test_runtime_kernels_avx2.py), for a float32 K/V pool (no KV-cache quantization).

constexpr int64_t kW4 = 4;  // Projection32's integer path over INT4 codes (w4a8)

// Rows through MKL's packed float32 GEMM in calls of exactly `tile` rows, the last padded with zeros
// (kernels_avx2.MklTiles says why): torch's mkl::_mkl_linear (pytorch/pytorch aten/src/ATen/native/mkldnn/
// Linear.cpp), cblas_sgemm_compute over weights packed by mkl::_mkl_reorder_linear_weight for `tile` rows.
at::Tensor mkl_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& shape,
                     const c10::optional<at::Tensor>& bias, int64_t tile) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkl::_mkl_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            int64_t)>();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && tile > 0, "rtk_avx2.mkl_tiles: x is [rows, K] float32");
  const int64_t m = x.size(0), tiles = (m + tile - 1) / tile;
  if (m == 0) return at::empty({0, shape.size(0)}, x.options());
  at::Tensor in = x.contiguous();
  if (m % tile) in = at::cat({in, at::zeros({tiles * tile - m, x.size(1)}, x.options())});
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < tiles; ++t) out.push_back(op.call(in.narrow(0, t * tile, tile), packed, shape, bias, tile));
  at::Tensor y = tiles == 1 ? out[0] : at::cat(out);
  return m % tile ? y.narrow(0, 0, m) : y;
}

struct Projection32 {
  bool w8a8_path = false;
  at::Tensor weights;                   // gemv: [N, K] as stored; w8a8: int8 codes
  int64_t kind = 0;                     // gemv's kind; on the w8a8 path kW4 for INT4 codes (w4a8)
  c10::optional<at::Tensor> scales;     // gemv's scales; w8a8's oscale
  double w8a8_scale = 0.0;              // w8a8's input scale
  c10::optional<at::Tensor> bias, pre_quant_scale;
  int64_t act_kind = 0;                 // the gemv input's quantize-dequantize: 0 none, 1 fp8, 2 int8
  double act_scale = 1.0;              // its scale (a float32 value)
  bool torch_input = false;             // quantize the input through ATen's operators, not quantize_input
  // gemv only: the float32 weights [N, K] that prompt rows multiply through at::linear (MKL), as
  // model.Projection does, padded with zero rows to pad_rows when fewer (its _padded); with mkl_tile, MKL's
  // packed weights for calls of mkl_tile rows (mkl_tiles); none: decode rows only
  c10::optional<at::Tensor> dense;
  int64_t pad_rows = 1;
  int64_t mkl_tile = 0;
  at::Tensor mkl_shape;  // [N, K] float32 of stride 0 (kernels_avx2.MklTiles.shape)
  bool blockwise = false;               // w8a8 of a weight-only INT8 projection: w8a8_blockwise (no input scale)
  c10::optional<at::Tensor> plain;      // w8a8's codes in the export's order, for calls of many rows (w8a8)
  c10::optional<at::Tensor> tiles;      // w4a8's codes for its prompt rows in the tile layout (kernels_avx2.pack_tiles)
  c10::optional<at::Tensor> tile_scales;  // and its scales so (kernels_avx2.pack_tile_scales)
  bool tiles_amx = false;               // which kernel reads them: AMX's (w4a8_tiles) or AVX512-VNNI's (w4a8_lanes)
  bool gemv_rows = false;               // gemv takes prompt rows too (model.Projection.gemv_prompt_rows)

  bool takes_prompt_rows() const { return w8a8_path || dense.has_value() || gemv_rows; }

  // rows of an INT4 projection with tiles: AMX's kernel (prompt rows) or the lanes' (every row), the same bits
  at::Tensor tile_rows(const at::Tensor& x, const float* ps) const {
    return tiles_amx ? w4a8_tiles_scaled(x, ps, *tiles, *tile_scales, bias)
                     : w4a8_lanes_scaled(x, ps, *tiles, *tile_scales, bias);
  }

  // model.Projection's input: times the pre-quant scale, then the activation's quantize-dequantize
  at::Tensor input(const at::Tensor& x) const {
    if (!pre_quant_scale.has_value() && act_kind == kActNone) return x;
    if (!torch_input) return quantize_input(x, pre_quant_scale, act_kind, act_scale);
    at::Tensor in = pre_quant_scale.has_value() ? at::mul(x, *pre_quant_scale) : x;
    const at::Tensor s = at::scalar_tensor(act_scale, at::kFloat);
    if (act_kind == kActFp8) return at::div(in, s).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat).mul(s);
    if (act_kind == kActInt8) return at::div(in, s).round().clamp(-128, 127).mul(s);
    return in;
  }

  // Rows [0, B) are decode rows, the rest prompt rows: W8A8 takes them all (a row's result is its own), W4A8
  // too (w4a8, or w4a8_lanes with tiles but no AMX) or, with AMX tiles, its prompt rows w4a8_tiles; gemv takes
  // the decode rows and at::linear the prompt rows, as model.Projection splits them.
  // by_count > 0 (DecodeLayers.tile_decode_rows, decode_batching "full": no batch invariance): an INT4 call of at
  // least by_count rows takes w4a8_tiles for every row, a smaller one w4a8, as model.Projection without singles
  at::Tensor rows(const at::Tensor& x, int64_t B, int64_t by_count = 0) const {
    if (w8a8_path && blockwise) {  // kernels_avx2.W8A8Weight / W4A8Weight: the pre_quant_scale applied as they quantize
      TORCH_CHECK(!pre_quant_scale.has_value() || pre_quant_scale->numel() == x.size(1),
                  "rtk_avx2.DecodeLayers: pre_quant_scale has the input's width");
      const float* ps = pre_quant_scale.has_value() ? pre_quant_scale->data_ptr<float>() : nullptr;
      if (kind != kW4) return w8a8_blockwise_scaled(x, ps, weights, *scales, bias);
      if (tiles.has_value() && !tiles_amx) return tile_rows(x, ps);  // the lanes take every row (W4A8Weight.lanes)
      const int64_t m = x.size(0);
      if (tiles.has_value() && by_count > 0)
        return m >= by_count ? tile_rows(x, ps) : w4a8_scaled(x, ps, weights, *scales, bias);
      if (!tiles.has_value() || B == m) return w4a8_scaled(x, ps, weights, *scales, bias);
      const at::Tensor prompt = tile_rows(x.narrow(0, B, m - B), ps);
      return B == 0 ? prompt : at::cat({w4a8_scaled(x.narrow(0, 0, B), ps, weights, *scales, bias), prompt});
    }
    if (w8a8_path) return w8a8(x, w8a8_scale, weights, *scales, bias, pre_quant_scale, plain);  // the scale folded in
    const at::Tensor in = input(x);
    const int64_t m = in.size(0);
    if (B == m || gemv_rows) return gemv(in, weights, kind, scales, bias);
    TORCH_CHECK(dense.has_value(), "rtk_avx2.DecodeLayers: prompt rows need the projection's float32 weights");
    at::Tensor prompt = in.narrow(0, B, m - B);
    at::Tensor y;
    if (mkl_tile > 0) {
      y = mkl_tiles(prompt, *dense, mkl_shape, bias, mkl_tile);
    } else if (m - B < pad_rows) {
      prompt = at::cat({prompt, at::zeros({pad_rows - (m - B), in.size(1)}, in.options())});
      y = at::linear(prompt, *dense, bias).narrow(0, 0, m - B);
    } else {
      y = at::linear(prompt, *dense, bias);
    }
    return B == 0 ? y : at::cat({gemv(in.narrow(0, 0, B), weights, kind, scales, bias), y});
  }
};

struct Layer32 {
  at::Tensor input_norm, post_norm;  // float32 [hidden]
  std::vector<Projection32> proj;    // qkv, o, gate_up, down
};

// model.py's RMSNorm on float32: weight * F.rms_norm(x), i.e. torch's rms_norm_composite
// (aten/src/ATen/native/layer_norm.cpp: pow(x, 2), mean = sum / k, add eps, rsqrt = 1 / sqrt, times x)
// times the weight.  Every step is one correctly rounded float operation except the sum, whose
// vectorized order only ATen's sum reproduces, so that one is ATen's.  (at::rms_norm itself ran its
// composite as ~10 operators, ~70 us a call at one row and ~210 us at 60: 61 calls a step.)  Used by
// DecodeLayers and, as the op rms_norm, by model.py's operator path for prompt rows.
at::Tensor rms_norm_f32(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "rtk_avx2.rms_norm: x must be [rows, k] float32");
  TORCH_CHECK(weight_in.scalar_type() == at::kFloat && weight_in.numel() == x_in.size(1),
              "rtk_avx2.rms_norm: weight must be [k] float32");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  auto squares = at::empty({m, k}, at::kFloat);
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < m * k; ++i) sq[i] = xs[i] * xs[i];
  auto sums = at::sum(squares, {1}, true);
  const float* ss = sums.data_ptr<float>();
  auto out = at::empty({m, k}, at::kFloat);
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < m; ++r) {
    const float inv = 1.0f / std::sqrt(ss[r] / static_cast<float>(k) + e);
    for (int64_t c = 0; c < k; ++c) os[r * k + c] = ws[c] * (xs[r * k + c] * inv);
  }
  return out;
}

struct DecodeLayers : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  at::Tensor cos, sin;  // float32 [positions, head_dim]; sin signed as model.rope_tables makes it
  std::vector<Layer32> layers;
  // decode_batching "full", where a row's bits may depend on its step's other rows: INT4 projections with tiles take
  // calls of this many rows on through w4a8_tiles, smaller ones through w4a8 (Projection32::rows); 0: by row kind
  int64_t tile_decode_rows = 0;

  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, at::Tensor cos,
               at::Tensor sin)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), scale(scale), cos(cos.contiguous()),
        sin(sin.contiguous()) {
    TORCH_CHECK(this->cos.scalar_type() == at::kFloat && this->sin.scalar_type() == at::kFloat &&
                    this->cos.size(1) == head_dim && head_dim % 2 == 0 && heads % kv_heads == 0,
                "rtk_avx2.DecodeLayers: float32 rope tables [positions, head_dim], heads a multiple of kv_heads");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm) {
    TORCH_CHECK(input_norm.scalar_type() == at::kFloat && post_norm.scalar_type() == at::kFloat,
                "rtk_avx2.DecodeLayers: float32 norm weights");
    layers.push_back({input_norm.contiguous(), post_norm.contiguous(), {}});
  }

  void add_projection(bool w8a8_path, at::Tensor weights, int64_t kind, c10::optional<at::Tensor> scales,
                      double w8a8_scale, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> pre_quant_scale,
                      int64_t act_kind, c10::optional<at::Tensor> act_scale, c10::optional<at::Tensor> dense,
                      int64_t pad_rows, bool torch_input, bool blockwise, c10::optional<at::Tensor> plain,
                      int64_t mkl_tile, c10::optional<at::Tensor> tiles, c10::optional<at::Tensor> tile_scales,
                      bool tiles_amx, bool gemv_rows) {
    TORCH_CHECK(!layers.empty() && layers.back().proj.size() < 4, "rtk_avx2.DecodeLayers: add_layer first");
    TORCH_CHECK(act_kind == 0 || act_scale.has_value(), "rtk_avx2.DecodeLayers: a quantized input needs its scale");
    TORCH_CHECK(!w8a8_path || scales.has_value(), "rtk_avx2.DecodeLayers: w8a8 needs its output scales");
    TORCH_CHECK(!dense.has_value() || (!w8a8_path && dense->scalar_type() == at::kFloat && dense->dim() == 2),
                "rtk_avx2.DecodeLayers: a gemv projection's prompt weights are [N, K] float32");
    TORCH_CHECK(mkl_tile == 0 || dense.has_value(), "rtk_avx2.DecodeLayers: MKL tiles need their packed weights");
    TORCH_CHECK(pad_rows >= 1, "rtk_avx2.DecodeLayers: pad_rows >= 1");
    TORCH_CHECK(!blockwise || w8a8_path, "rtk_avx2.DecodeLayers: blockwise is a w8a8 projection's");
    TORCH_CHECK(!pre_quant_scale.has_value() || (pre_quant_scale->scalar_type() == at::kFloat &&
                                                 pre_quant_scale->dim() == 1 && pre_quant_scale->is_contiguous()),
                "rtk_avx2.DecodeLayers: pre_quant_scale is [K] float32, contiguous");
    TORCH_CHECK(!tiles.has_value() || (w8a8_path && kind == kW4),
                "rtk_avx2.DecodeLayers: prompt tiles are an INT4 projection's (w4a8_tiles, w4a8_lanes)");
    TORCH_CHECK(tiles.has_value() == tile_scales.has_value(), "rtk_avx2.DecodeLayers: tiles come with their scales");
    TORCH_CHECK(!gemv_rows || !w8a8_path, "rtk_avx2.DecodeLayers: gemv_rows is a gemv projection's");
    TORCH_CHECK(!w8a8_path || kind == 0 || (kind == kW4 && blockwise),
                "rtk_avx2.DecodeLayers: an integer projection's codes are INT8 (kind 0) or blockwise INT4 (kind 4)");
    layers.back().proj.push_back({w8a8_path, weights, kind, scales, w8a8_scale, bias, pre_quant_scale, act_kind,
                                  act_scale.has_value() ? act_scale->item<double>() : 1.0, torch_input, dense,
                                  pad_rows, mkl_tile,
                                  mkl_tile > 0 ? at::zeros({}, at::kFloat).expand({weights.size(0), weights.size(1)})
                                               : at::Tensor(),
                                  blockwise, plain, tiles, tile_scales, tiles_amx, gemv_rows});
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const { return rms_norm_f32(x, weight, eps); }

  static void add_into(at::Tensor& h, const at::Tensor& y) {  // h = h + y, one float32 rounding each
    float* hs = h.data_ptr<float>();
    const float* ys = y.data_ptr<float>();
    const int64_t n = h.numel();
    for (int64_t i = 0; i < n; ++i) hs[i] = hs[i] + ys[i];
  }

  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor write_slots, at::Tensor ctx_slots,
                     at::Tensor ctx_bounds, at::Tensor k_pool, at::Tensor v_pool, int64_t begin, int64_t end,
                     c10::optional<at::Tensor> padded_slots, c10::optional<at::Tensor> padded_mask) {
    const int64_t m = h.size(0);
    check_pools(h, k_pool, v_pool);
    check_decode_plan("rtk_avx2.DecodeLayers", m, positions, write_slots, ctx_slots, ctx_bounds, k_pool, begin, end,
                      static_cast<int64_t>(layers.size()), cos.size(0), padded_slots, padded_mask);
    return run(h, m, positions, write_slots, ctx_slots, ctx_bounds, k_pool, v_pool, begin, end, {});
  }

  // A step with prompt rows: rows [0, num_decode) decode as forward's rows do, the rest are prompt chunks
  // (decode_plan.h, PromptPlan).  Each projection takes every row through its W8A8 kernel (a row's result is
  // its own) or its decode rows through gemv and its prompt rows through at::linear over its float32 weights,
  // as model.Projection splits a call: so every row's numbers are the operator path's
  // (model.Transformer._layers), decode rows' and prompt rows' alike.
  at::Tensor forward_rows(at::Tensor h, int64_t num_decode, at::Tensor positions, at::Tensor write_slots,
                          at::Tensor ctx_slots, at::Tensor ctx_bounds, at::Tensor k_pool, at::Tensor v_pool,
                          int64_t begin, int64_t end, at::Tensor chunks, std::vector<at::Tensor> chunk_slots,
                          at::Tensor units, std::vector<at::Tensor> unit_masks) {
    const char* who = "rtk_avx2.DecodeLayers.forward_rows";
    const int64_t m = h.size(0), B = num_decode;
    check_pools(h, k_pool, v_pool);
    for (const Layer32& layer : layers)
      for (const Projection32& p : layer.proj)
        TORCH_CHECK(p.takes_prompt_rows(), who, ": prompt rows need W8A8 projections or the float32 weights");
    const PromptStep step = check_prompt_step(who, m, B, positions, write_slots, ctx_slots, ctx_bounds, k_pool, begin,
                                              end, static_cast<int64_t>(layers.size()), cos.size(0), chunks,
                                              std::move(chunk_slots), units, std::move(unit_masks), {}, {});
    return run(h, B, positions, write_slots, ctx_slots, ctx_bounds, k_pool, v_pool, begin, end, step.prompts);
  }

 private:
  void check_pools(const at::Tensor& h, const at::Tensor& k_pool, const at::Tensor& v_pool) const {
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2, "rtk_avx2.DecodeLayers: h is [rows, hidden] float32");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4 &&
                    k_pool.size(2) == kv_heads && k_pool.size(3) == head_dim && k_pool.scalar_type() == at::kFloat &&
                    v_pool.scalar_type() == at::kFloat,
                "rtk_avx2.DecodeLayers: float32 K/V pools [layers, slots, kv_heads, head_dim]");
  }

  // The layers over all rows of h; decode rows [0, B) attend through decode_attention, prompt rows (if
  // any) by chunk and unit through torch's SDPA, as model.Transformer._layers calls it.
  at::Tensor run(at::Tensor h, int64_t B, const at::Tensor& positions, const at::Tensor& write_slots,
                 const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, int64_t begin, int64_t end, const PromptPlan& prompts) {
    const int64_t m = h.size(0), H = heads, KVH = kv_heads, D = head_dim, half = D / 2;
    const int64_t slots = k_pool.size(1);
    const auto* pos = positions.data_ptr<int64_t>();
    const auto* ws = write_slots.data_ptr<int64_t>();
    const auto* cs = ctx_slots.data_ptr<int64_t>();
    const auto* cb = ctx_bounds.data_ptr<int64_t>();
    h = h.contiguous().clone();
    const float* cos_t = cos.data_ptr<float>();
    const float* sin_t = sin.data_ptr<float>();
    const int64_t row = KVH * D, layer_floats = slots * row;
    const bool gqa = KVH != H;
    for (int64_t li = begin; li < end; ++li) {
      const Layer32& layer = layers[li];
      auto qkv = layer.proj[0].rows(rms_norm(h, layer.input_norm), B, tile_decode_rows).contiguous();  // [m, (H + 2 KVH) D]
      const float* src = qkv.data_ptr<float>();
      const int64_t width = (H + 2 * KVH) * D;
      // RoPE on the q and k heads as model.py: x * cos + x[swap] * signed sin, three float32 roundings
      auto qk = at::empty({m, H + KVH, D}, at::kFloat);
      float* dst = qk.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) {
        const float* c = cos_t + pos[r] * D;
        const float* s = sin_t + pos[r] * D;
        for (int64_t hd = 0; hd < H + KVH; ++hd) {
          const float* v = src + r * width + hd * D;
          float* o = dst + (r * (H + KVH) + hd) * D;
          // x[swap] is the other half: two loops, no index arithmetic in the way of the vectorizer
          for (int64_t d = 0; d < half; ++d) o[d] = v[d] * c[d] + v[d + half] * s[d];
          for (int64_t d = half; d < D; ++d) o[d] = v[d] * c[d] + v[d - half] * s[d];
        }
      }
      float* kp = k_pool.data_ptr<float>() + li * layer_floats;
      float* vp = v_pool.data_ptr<float>() + li * layer_floats;
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(kp + ws[r] * row, dst + (r * (H + KVH) + H) * D, row * sizeof(float));
        std::memcpy(vp + ws[r] * row, src + r * width + (H + KVH) * D, row * sizeof(float));
      }
      // every decode row over its own context in the pool (batched or not: the padded plan is checked, not read)
      auto attn = at::empty({m, H * D}, at::kFloat);
      if (B > 0)
        rtk_attention::decode_attention_rows(dst, (H + KVH) * D, D, kp, vp, cs, cb, B, H, KVH, D, static_cast<float>(scale),
                              attn.data_ptr<float>());
      if (B < m) prompt_attention(qk, qkv, k_pool[li], v_pool[li], prompts, gqa, attn);
      add_into(h, layer.proj[1].rows(attn, B, tile_decode_rows).contiguous());
      auto gu = layer.proj[2].rows(rms_norm(h, layer.post_norm), B, tile_decode_rows).contiguous();
      const int64_t inter = gu.size(1) / 2;
      // torch's SiLU (its exp) row by row, then the product; rows shared between threads (torch's own kernel
      // keeps a call under 32,768 elements on one thread, while the other waits)
      auto act = at::empty({m, inter}, at::kFloat);
      float* ac = act.data_ptr<float>();
      const float* up = gu.data_ptr<float>() + inter;
      const bool inference = c10::InferenceMode::is_enabled();  // the pool's workers do not inherit the caller's
      at::parallel_for(0, m, std::max<int64_t>(1, 4096 / inter), [&](int64_t r0, int64_t r1) {
        const c10::InferenceMode mode(inference);
        at::Tensor part = act.narrow(0, r0, r1 - r0);
        at::silu_out(part, gu.narrow(0, r0, r1 - r0).narrow(1, 0, inter));
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t i = 0; i < inter; ++i) ac[r * inter + i] = ac[r * inter + i] * up[r * 2 * inter + i];
      });
      add_into(h, layer.proj[3].rows(act, B, tile_decode_rows).contiguous());
    }
    return h;
  }

  // Prompt rows' attention with the views and SDPA calls of model.Transformer._layers: q the rotated q
  // heads, a chunk's keys its own rotated k heads and v (from the qkv rows) or the pool's at its slots.
  void prompt_attention(const at::Tensor& qk, const at::Tensor& qkv, const at::Tensor& k_layer,
                        const at::Tensor& v_layer, const PromptPlan& p, bool gqa, at::Tensor& attn) const {
    const int64_t H = heads, KVH = kv_heads, D = head_dim, m = qk.size(0);
    const at::Tensor q = qk.narrow(1, 0, H), k = qk.narrow(1, H, KVH);
    const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({m, KVH, D});
    const auto* ch = p.chunks.data_ptr<int64_t>();
    int64_t u = 0;
    for (int64_t c = 0; c < p.chunks.size(0); ++c) {
      const int64_t start = ch[3 * c], len = ch[3 * c + 1];
      at::Tensor kc, vc;
      if (p.chunk_slots[c].numel() == 0) {
        kc = k.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
        vc = v.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
      } else {
        kc = k_layer.index_select(0, p.chunk_slots[c]).transpose(0, 1).unsqueeze(0);
        vc = v_layer.index_select(0, p.chunk_slots[c]).transpose(0, 1).unsqueeze(0);
      }
      const at::Tensor qc = q.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
      u = attend_units(p, c, u, qc, kc, vc, scale, gqa, attn, start);
    }
  }
};

}  // namespace

#ifndef RTK_KERNELS_LIB
#define RTK_KERNELS_LIB rtk_avx2  // the VNNI build: -DRTK_KERNELS_LIB=rtk_vnni
#endif

TORCH_LIBRARY(RTK_KERNELS_LIB, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_projection", &DecodeLayers::add_projection)
      .def("forward", &DecodeLayers::forward)
      .def("forward_rows", &DecodeLayers::forward_rows)
      .def("set_tile_decode_rows", [](const c10::intrusive_ptr<DecodeLayers>& self, int64_t rows) {
        TORCH_CHECK(rows >= 0, "rtk_avx2.DecodeLayers: tile_decode_rows >= 0");
        self->tile_decode_rows = rows;
      });
  m.def("gemv(Tensor x, Tensor weights, int kind, Tensor? scales, Tensor? bias) -> Tensor", &gemv);
  m.def("argmax_rows(Tensor x) -> Tensor", &rtk_argmax::argmax_rows);
  m.def("w8a8(Tensor x, float act_scale, Tensor codes, Tensor oscale, Tensor? bias, Tensor? pre_quant_scale=None, "
        "Tensor? plain=None) -> Tensor",
        &w8a8);
  m.def("w8a8_blockwise(Tensor x, Tensor codes, Tensor oscale, Tensor? bias) -> Tensor", &w8a8_blockwise);
  m.def("w4a8(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor", &w4a8);
  m.def("w4a8_tiles(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor", &w4a8_tiles);
  m.def("tiles_available() -> bool", &tiles_available);
#ifdef RTK_WIDE_TILES
  m.def("w4a8_lanes(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor", &w4a8_lanes);
#endif
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_f32);
  m.def("mkl_tiles(Tensor x, Tensor packed, Tensor shape, Tensor? bias, int tile) -> Tensor", &mkl_tiles);
  m.def("quantize_input(Tensor x, Tensor? pre_quant_scale, int act_kind, float act_scale) -> Tensor", &quantize_input);
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor ctx_slots, Tensor ctx_bounds, float scale) "
        "-> Tensor",
        &decode_attention);
}
