// rtk's CPU kernels for the decode step (CPUs with AVX512-BF16), each bit-identical to what it replaces
// (1. gemv, 2. gemv_q, 3. quantize_input, 4. gather_kv below; gemv_q's INT4 group sums, kind int4-dot,
// excepted: within a tolerance of the float32 product), 5. DecodeLayers: the decode rows' whole
// decoder layers in one call (and a step's prompt rows, their projections through oneDNN's GEMM), and
// 6. decode_attention (decode_attention.h: within float32 rounding of SDPA, the attention of DecodeLayers and
// of model.py's operators alike).
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
// with zeros), so one thread reads each block as one contiguous stream.  (Block, group of 4 rows) pairs are
// split across torch's intra-op threads (at::parallel_for: the same OpenMP pool as torch's own operators).
// On CPUs with AMX-BF16, where oneDNN runs its AMX kernel, the same products run in AMX's tiles with that kernel's
// order instead (1b, tile_blocks).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"  // tile_blocks
#include "argmax_rows.h"
#include "decode_attention.h"
#include "decode_plan.h"
#include "sdpa_decode.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RTK_GEMV_TILES 1
#endif

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

struct Int4DotWeights;

// A row's float32 sums of outputs [first, first + 16) (fewer where n ends first) into its bf16 outputs: the bias added
// in float32, then one round to nearest even
inline void store_outputs(const float* sums, const float* bias, int64_t first, int64_t n, uint16_t* row) {
  const int64_t count = std::min<int64_t>(16, n - first);
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  __m512 v = _mm512_loadu_ps(sums);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + first));
  _mm256_mask_storeu_epi16(row + first, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// 1b. The same products in AMX's bf16 tiles (Intel Sapphire Rapids and later; set_gemv_tiles).  On such CPUs
// oneDNN's bf16 matmul (one row or many) runs tdpbf16ps with one float32 accumulator tile per 16 outputs carried
// from the first input to the last, no chunks; then the bias in float32 and one round to nearest even.  The tile
// unit sums within an instruction in its own order (not the SDM pseudo-code's sequential one: vdpbf16ps with the
// pairs swapped and one accumulator does not reproduce it, docs/engine-measurements.md "Codes prefetched ahead of the
// tiles' conversion"), so the GEMV's vdpbf16ps results part from oneDNN's in a few outputs there
// (docs/engine-measurements.md, "Intel CPUs with AMX").  tile_blocks makes the same tdpbf16ps sequence as oneDNN: every
// row of any call gets oneDNN's one-row bits (checked at load as before: kernels.agrees, QuantizedWeight.agrees), a
// row's bits never depend on its call, and the weights stream at the memory's speed for one row as for many.  bf16
// weights are read into B tiles straight from the packed layout (a k-pair's 64 outputs are 4 tile rows of 16 outputs x
// 2); codes are turned into bf16 by their loader (the GEMV's, the same bits) into a tile-ordered buffer, a tile's 16
// pairs one tile ahead of the first row tile's products; further row tiles read the buffer.
bool gemv_tiles_on = false;

#ifdef RTK_GEMV_TILES
using rtk_amx::TileConfig;
using rtk_amx::tiles_permitted;

// How far ahead of the conversion tile_blocks prefetches codes.  Without it a one-row call over FP8 codes took as
// long as over bf16 weights (twice the bytes): the conversion's work did not overlap the codes' arrival; with 2-8 KiB
// ahead it takes 0.58-0.70x (docs/engine-measurements.md, "Codes prefetched ahead of the tiles' conversion").
constexpr int64_t kCodesAhead = 4096;

// gemv_blocks' ys = xs W^T (+ bs) over m rows in tiles: tiles 0-3 a row tile's sums for the block's 4 x 16 outputs,
// 4 its inputs (up to 16 rows x 32), 5 the weights of 16 pairs x 16 outputs.  Threads share the blocks.
template <class Weights, class MakeWeights>
void tile_blocks(const uint16_t* xs, int64_t m, const float* bs, uint16_t* ys, int64_t blocks, int64_t pairs,
                 int64_t group_pairs, int64_t n, MakeWeights make_weights) {
  constexpr bool direct = std::is_same_v<Weights, Bf16Weights>;
  constexpr int64_t column = direct ? 32 : 512;  // from one 16-output tile of weights to the next
  const int64_t tiles_k = pairs / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<uint16_t> buffer;  // a block's converted weights: [tile][j][16 pairs][32]
    uint16_t* wb = nullptr;
    if constexpr (!direct) {
      buffer.resize(std::max<size_t>(buffer.size(), static_cast<size_t>(pairs) * kBlock * 2 + 32));
      wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    }
    int configured = -1;
    alignas(64) float sums[4][256];
    for (int64_t b = b0; b < b1; ++b) {
      auto weights = make_weights(b);
      int64_t next_group = 0;
      const auto convert = [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k) {
          if constexpr (!direct) {  // codes kCodesAhead bytes on (past the block's end: the thread's next block)
            const char* ahead = reinterpret_cast<const char*>(weights.codes + k * Weights::kPairBytes) + kCodesAhead;
            for (int64_t l = 0; l < Weights::kPairBytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
          }
          if (k == next_group) weights.begin_group(k / group_pairs), next_group += group_pairs;
          __m512bh w[4];
          weights.load(k, w);
          for (int j = 0; j < 4; ++j) _mm512_store_si512(wb + (((k / 16) * 4 + j) * 16 + k % 16) * 32, (__m512i)w[j]);
        }
      };
      if constexpr (!direct) convert(0, 16);
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - r0));
        if (rows != configured) {  // the last row tile's own row count: no padding rows
          TileConfig cfg;
          for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
          cfg.rows[5] = 16, cfg.colsb[5] = 64;
          _tile_loadconfig(&cfg);
          configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < tiles_k; ++t) {
          const uint16_t* tile;
          int64_t stride;
          if constexpr (direct) {
            tile = weights.base + t * 16 * kBlock * 2;
            stride = kBlock * 2 * 2;
            if (t + 1 < tiles_k)  // the next tile's 4 KiB: tile loads are strided, the prefetcher lags them
              for (int l = 0; l < 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(tile + 16 * kBlock * 2) + 64 * l, _MM_HINT_T0);
          } else {  // the next tile's pairs converted before this one's products (its stores drain meanwhile)
            if (r0 == 0 && t + 1 < tiles_k) convert(16 * (t + 1), 16 * (t + 2));
            tile = wb + t * 4 * 512;
            stride = 64;
          }
          _tile_loadd(4, xs + r0 * 2 * pairs + 32 * t, 4 * pairs);
          _tile_loadd(5, tile, stride);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, tile + column, stride);
          _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, tile + 2 * column, stride);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, tile + 3 * column, stride);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        for (int j = 0; j < 4 && b * kBlock + j * 16 < n; ++j)
          for (int r = 0; r < rows; ++r) store_outputs(sums[j] + r * 16, bs, b * kBlock + j * 16, n, ys + (r0 + r) * n);
      }
    }
    _tile_release();
  });
}
#endif

// Whether the GEMVs (bf16 and codes, int4-dot excepted) run in AMX's tiles from now on (tile_blocks): on asks for
// them, granted where this build has them and Linux grants the tile data.  Returns what holds.
bool set_gemv_tiles(bool on) {
#ifdef RTK_GEMV_TILES
  gemv_tiles_on = on && tiles_permitted();
#else
  gemv_tiles_on = false;
#endif
  return gemv_tiles_on;
}

template <int R>
inline void block_rows_dot(const uint32_t* xs, int64_t r0, const Int4DotWeights& weights, int64_t pairs,
                           int64_t group_pairs, float* total);

// block_rows, or block_rows_dot for factored int4 codes
template <int R, class Weights>
inline void rows_of_block(const uint32_t* xs, int64_t r0, Weights& weights, int64_t pairs, int64_t group_pairs,
                          float* total) {
  if constexpr (std::is_same_v<Weights, Int4DotWeights>)
    block_rows_dot<R>(xs, r0, weights, pairs, group_pairs, total);
  else
    block_rows<R>(xs, r0, weights, pairs, group_pairs, total);
}

// y = x W^T (+ bias) over the blocks, rows in groups of 4; make_weights(b) gives block b's loader.  The threads
// share (block, group of rows) pairs, block by block: with one group that is the blocks; with more (prompt rows,
// many decode rows) the split is even where the block count is not (SmolLM2's 9-block projections on 2 threads:
// 5 blocks against 4, the second thread waiting a fifth of the call).  A row's arithmetic is the same either way.
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
#ifdef RTK_GEMV_TILES
  using Weights = decltype(make_weights(int64_t{0}));
  if constexpr (!std::is_same_v<Weights, Int4DotWeights>)  // int4-dot's group sums round their own way
    if (gemv_tiles_on && pairs % 16 == 0) {
      if (m > 0)
        tile_blocks<Weights>(reinterpret_cast<const uint16_t*>(xs), m, bs, ys, blocks, pairs, group_pairs, n,
                             make_weights);
      return y;
    }
#endif
  const int64_t groups = (m + 3) / 4;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float total[4 * kBlock];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / groups, r0 = i % groups * 4;
      auto weights = make_weights(b);
      const int rows = static_cast<int>(std::min<int64_t>(4, m - r0));
      switch (rows) {
        case 4: rows_of_block<4>(xs, r0, weights, pairs, group_pairs, total); break;
        case 3: rows_of_block<3>(xs, r0, weights, pairs, group_pairs, total); break;
        case 2: rows_of_block<2>(xs, r0, weights, pairs, group_pairs, total); break;
        default: rows_of_block<1>(xs, r0, weights, pairs, group_pairs, total); break;
      }
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < 4 && b * kBlock + j * 16 < n; ++j)
          store_outputs(total + (r * 4 + j) * 16, bs, b * kBlock + j * 16, n, ys + (r0 + r) * n);
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
//    fp8 e4m3: the byte's magnitude bits shifted into a float32's exponent and mantissa (exponent
//    bias 127 instead of 7: the code's value times 2^-120, subnormal codes as float subnormals),
//    with 2^120 folded into the scale (exact).

enum QuantKind : int64_t { kInt8 = 0, kFp8 = 1, kInt4 = 2, kFp8Table = 3, kInt4Dot = 4 };

inline __m512 codes8_to_float(__m128i bytes, int64_t kind) {
  if (kind == kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  // sign-extended to 32 bits and shifted by 20: the magnitude's exponent and mantissa bits land in a
  // float's (bits 20-26), the sign at 27-31; keeping bit 31 makes the float the code's value times
  // 2^-120 exactly (normal and subnormal codes alike), 2^120 being folded into the scale
  const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20);
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
}

const __m512 kInt4Values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);

template <int64_t Kind>
struct QuantWeights {
  static constexpr int64_t kPairBytes = Kind == kInt4 ? kBlock : kBlock * 2;  // one k-pair's codes
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
};

//    fp8 e4m3 codes whose 64-output block shares one scale (per-tensor FP8 scales; fused q/k/v and
//    gate/up parts start at multiples of 64 outputs): bf16(float(code) * scale) is then one of 128
//    magnitudes per block, with the code's sign (round to nearest even is symmetric).  The block's
//    128 bf16 magnitudes are a table of low bytes and one of high bytes, two registers each, looked up
//    with vpermi2b (AVX512-VBMI, 64 codes per instruction): no conversion or multiplication per
//    weight, so the GEMV reads the codes at memory speed instead of being bound by the arithmetic
//    (about 3x the per-weight conversion above on the development host).  Codes are packed as the
//    8-bit layout with each k-pair's 128 bytes reordered for vpunpck{l,h}bw, which interleave within
//    128-bit lanes: in half h (64 bytes), byte 16L + 8q + i is word 8L + i of weight vector 2h + q.
struct Fp8TableWeights {
  static constexpr int64_t kPairBytes = kBlock * 2;
  const uint8_t* codes;  // the block's first k-pair
  const uint8_t* table;  // the block's 256 bytes: the 128 magnitudes' low bytes, then their high bytes
  __m512i lo0, lo1, hi0, hi1;
  inline void begin_group(int64_t) {
    lo0 = _mm512_loadu_si512(table);
    lo1 = _mm512_loadu_si512(table + 64);
    hi0 = _mm512_loadu_si512(table + 128);
    hi1 = _mm512_loadu_si512(table + 192);
  }
  inline void load(int64_t k, __m512bh w[4]) const {
    const uint8_t* row = codes + k * kBlock * 2;
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h) {
      const __m512i c = _mm512_loadu_si512(row + 64 * h);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);  // index: the code's low 7 bits
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);  // | sign
      w[2 * h] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
      w[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
    }
  }
};

//    int4 codes with per-group scales, factored (kind int4-dot): y = sum over groups of
//    scale[n, g] * (sum over the group's k of code * x), the inner sums by vdpbf16ps over the codes
//    as bf16 (-8..7 are exact in bf16) and each group's sum scaled into the output's float32 total
//    with one FMA.  No per-weight multiplication or rounding: a code becomes its bf16 bits by two
//    16-entry byte lookups (vpshufb), so the kernel reads 4-bit codes at close to memory speed.
//    It does not give the dense path's bits (that rounds code * scale to bf16 per weight, this does
//    not round the weight at all, as llama.cpp's and TensorRT-LLM's W4A16 kernels do not), so its use
//    is checked against the float32 product within a tolerance; each row is still computed alone,
//    so results do not depend on the batch.
//    Codes: [ceil(N/64), K/2, 64] bytes, each k-pair's 128 offset codes (code + 8) in the order the
//    lookups and vpunpck{l,h}bw need: byte 16L + 8q + i holds word 8L + i of weight vector q in its
//    low nibble and of vector 2 + q in its high nibble.  Scales: [ceil(N/64), groups, 64] float32.
struct Int4DotWeights {
  const uint8_t* codes;  // the block's first k-pair
  const float* scales;   // the block's [groups, 64]
  inline void load(int64_t k, __m512bh w[4]) const {
    // bf16 bits of -8..7, indexed by the offset code: low bytes and high bytes, in every 128-bit lane
    const __m512i lo_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(
        0x00, static_cast<char>(0xE0), static_cast<char>(0xC0), static_cast<char>(0xA0), static_cast<char>(0x80),
        0x40, 0x00, static_cast<char>(0x80), 0x00, static_cast<char>(0x80), 0x00, 0x40, static_cast<char>(0x80),
        static_cast<char>(0xA0), static_cast<char>(0xC0), static_cast<char>(0xE0)));
    const __m512i hi_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(
        static_cast<char>(0xC1), static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xC0),
        static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xBF), 0x00,
        0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40));
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i c = _mm512_loadu_si512(codes + k * kBlock);
    const __m512i lo = _mm512_and_si512(c, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
    const __m512i lo_l = _mm512_shuffle_epi8(lo_bytes, lo), lo_h = _mm512_shuffle_epi8(hi_bytes, lo);
    const __m512i hi_l = _mm512_shuffle_epi8(lo_bytes, hi), hi_h = _mm512_shuffle_epi8(hi_bytes, hi);
    w[0] = (__m512bh)_mm512_unpacklo_epi8(lo_l, lo_h);
    w[1] = (__m512bh)_mm512_unpackhi_epi8(lo_l, lo_h);
    w[2] = (__m512bh)_mm512_unpacklo_epi8(hi_l, hi_h);
    w[3] = (__m512bh)_mm512_unpackhi_epi8(hi_l, hi_h);
  }
};

// Rows [r0, r0 + R) of x times one 64-output block of int4-dot codes: per group, the code sums by
// vdpbf16ps, then scaled into the total.
template <int R>
inline void block_rows_dot(const uint32_t* xs, int64_t r0, const Int4DotWeights& weights, int64_t pairs,
                           int64_t group_pairs, float* total) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < pairs; ++g, k0 += group_pairs) {
    __m512 p[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) p[r][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + group_pairs; ++k) {
      __m512bh w[4];
      weights.load(k, w);
      for (int r = 0; r < R; ++r) {
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[(r0 + r) * pairs + k]));
        for (int j = 0; j < 4; ++j) p[r][j] = _mm512_dpbf16_ps(p[r][j], xk, w[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 s = _mm512_loadu_ps(weights.scales + g * kBlock + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(p[r][j], s, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(total + (r * 4 + j) * 16, acc[r][j]);
}

// A block's bf16 weights in the Bf16Weights layout, from any of the loaders above.
template <class Weights>
void rebuild(Weights weights, uint16_t* out, int64_t pairs, int64_t group_pairs) {
  __m512bh w[4];
  for (int64_t k = 0; k < pairs; ++k) {
    if (k % group_pairs == 0) weights.begin_group(k / group_pairs);
    weights.load(k, w);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(out + (k * kBlock + 16 * j) * 2, (__m512i)w[j]);
  }
}

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
  if (kind == kFp8Table)  // byte 64h + 32q + 8L + i -> 64h + 16L + 8q + i (Fp8TableWeights)
    return inter.view({blocks, k / 2, 2, 2, 4, 8}).permute({0, 1, 2, 4, 3, 5}).contiguous().view({blocks, k / 2, 128});
  if (kind == kInt4Dot) {  // byte 16L + 8q + i: word 8L + i of vector q (low nibble) and of 2 + q (high)
    auto v = inter.view({blocks, k / 2, 2, 2, 4, 8}).to(at::kInt).add(8).bitwise_and(15);  // [.., h, q, L, i]
    auto lo = v.select(2, 0).permute({0, 1, 3, 2, 4}), hi = v.select(2, 1).permute({0, 1, 3, 2, 4});
    return lo.add(hi.mul(16)).to(at::kByte).contiguous().view({blocks, k / 2, kBlock});
  }
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

// scale: [blocks] float32, one per 64-output block -> [blocks, 256] uint8 (Fp8TableWeights): entry i
// (of 128) is bf16(float(e4m3 code i) * scale), rounded by c10's conversion as torch's .to(bf16) does
at::Tensor fp8_tables(const at::Tensor& block_scales) {
  auto s = block_scales.to(at::kFloat).contiguous();
  const int64_t blocks = s.numel();
  auto t = at::empty({blocks, 256}, at::kByte);
  auto* ts = t.data_ptr<uint8_t>();
  const float* scales = s.data_ptr<float>();
  float magnitudes[128];  // the value of each e4m3 code with its sign bit clear
  for (int i = 0; i < 128; ++i)
    magnitudes[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  for (int64_t b = 0; b < blocks; ++b)
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = c10::BFloat16(magnitudes[i] * scales[b]).x;
      ts[b * 256 + i] = static_cast<uint8_t>(bits & 0xFF);
      ts[b * 256 + 128 + i] = static_cast<uint8_t>(bits >> 8);
    }
  return t;
}

at::Tensor gemv_fp8_table(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& tables, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  const int64_t blocks = codes.size(0), pairs = codes.size(1);
  TORCH_CHECK(tables.scalar_type() == at::kByte && tables.dim() == 2 && tables.size(0) == blocks &&
                  tables.size(1) == 256 && tables.is_contiguous(),
              "rtk_kernels.gemv_q: fp8 tables are [blocks, 256] bytes (fp8_tables)");
  const auto* cs = codes.data_ptr<uint8_t>();
  const auto* ts = tables.data_ptr<uint8_t>();
  return gemv_blocks(x, blocks, pairs, pairs, n, bias, [&](int64_t b) {
    return Fp8TableWeights{cs + b * pairs * kBlock * 2, ts + b * 256, {}, {}, {}, {}};
  });
}

// scale: [N, groups] float32 -> [blocks, groups, 64] (Int4DotWeights; padding: zero scales)
at::Tensor pack_group_scales(const at::Tensor& scale) {
  auto s = scale.to(at::kFloat);
  TORCH_CHECK(s.dim() == 2, "rtk_kernels.pack_group_scales: [N, groups] scales");
  const int64_t n = s.size(0), groups = s.size(1);
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock, blocks = padded / kBlock;
  auto p = at::zeros({padded, groups}, s.options());
  p.narrow(0, 0, n).copy_(s);
  return p.view({blocks, kBlock, groups}).permute({0, 2, 1}).contiguous();
}

at::Tensor gemv_int4_dot(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  const int64_t blocks = codes.size(0), pairs = codes.size(1), groups = scales.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(2) == kBlock && pairs % groups == 0 &&
                  codes.size(2) == kBlock && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "rtk_kernels.gemv_q: int4-dot scales are [blocks, groups, 64] float32 (pack_group_scales)");
  const auto* cs = codes.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  return gemv_blocks(x, blocks, pairs, pairs / groups, n, bias, [&](int64_t b) {
    return Int4DotWeights{cs + b * pairs * kBlock, ss + b * groups * kBlock};
  });
}

at::Tensor gemv_q(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t kind, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "rtk_kernels.gemv_q: packed codes (pack_q)");
  if (kind == kFp8Table) return gemv_fp8_table(x, codes, scales, n, bias);
  if (kind == kInt4Dot) return gemv_int4_dot(x, codes, scales, n, bias);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 3,
              "rtk_kernels.gemv_q: packed scales (pack_scales)");
  if (kind == kInt8) return gemv_q_kind<kInt8>(x, codes, scales, n, bias);
  if (kind == kFp8) return gemv_q_kind<kFp8>(x, codes, scales, n, bias);
  TORCH_CHECK(kind == kInt4, "rtk_kernels.gemv_q: kind is 0 (int8), 1 (fp8) or 2 (int4)");
  return gemv_q_kind<kInt4>(x, codes, scales, n, bias);
}

// The bf16 weights gemv_q computes with, [N, K] (for the check at load against the dense weights).
at::Tensor unpack_q(const at::Tensor& codes, const at::Tensor& scales, int64_t kind, int64_t n) {
  TORCH_CHECK(kind != kInt4Dot, "rtk_kernels.unpack_q: int4-dot computes without rebuilding bf16 weights");
  const int64_t blocks = codes.size(0), pairs = codes.size(1), groups = kind == kFp8Table ? 1 : scales.size(1);
  auto out = at::empty({blocks, pairs, kBlock, 2}, at::kBFloat16);
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t per_pair = kind == kInt4 ? kBlock : kBlock * 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* c = codes.data_ptr<uint8_t>() + b * pairs * per_pair;
    uint16_t* o = os + b * pairs * kBlock * 2;
    if (kind == kFp8Table) {
      rebuild(Fp8TableWeights{c, scales.data_ptr<uint8_t>() + b * 256, {}, {}, {}, {}}, o, pairs, pairs);
      continue;
    }
    const float* s = scales.data_ptr<float>() + b * groups * 128;
    if (kind == kInt8) rebuild(QuantWeights<kInt8>{c, s, {}}, o, pairs, pairs / groups);
    else if (kind == kFp8) rebuild(QuantWeights<kFp8>{c, s, {}}, o, pairs, pairs / groups);
    else rebuild(QuantWeights<kInt4>{c, s, {}}, o, pairs, pairs / groups);
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

// 16 lanes of bf16 <-> float32 for DecodeLayers' elementwise steps, rounded as c10::BFloat16 rounds (nearest
// even, subnormals kept, NaN kept quiet): the scalar float_to_bf16 / bf16_to_float's bits, 16 at a time
inline __mmask16 lanes(int64_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1); }

inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  return bf16_bits_to_float(_mm256_maskz_loadu_epi16(mask, p));
}

inline __m512i bf16_bits_quiet(__m512 v) {  // bf16_round_bits, with a NaN's sign and top payload bits kept quiet
  const __m512i u = _mm512_castps_si512(v);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                                      _mm512_set1_epi32(0x00400000));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bf16_round_bits(v), nan);
}

inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(bf16_bits_quiet(v)); }

inline void store_bf16(uint16_t* p, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_quiet(v), 16)));
}

// rows [0, m) in at::parallel_for's shares where a call has enough elements to pay for the region, else here.
// The pool's workers spin between regions, so a share of ~4 K elements pays: a prompt chunk's 16-24 rows of
// SmolLM2 (576-1,536 elements each) go to both threads, a few decode rows stay on one (docs/engine-measurements.md,
// "The float32 fused layers' work on one thread").
constexpr int64_t kRowsShare = 4096;

template <class F>
inline void for_rows(int64_t m, int64_t row_elements, const F& f) {
  if (m * row_elements < 2 * kRowsShare) return f(0, m);
  at::parallel_for(0, m, std::max<int64_t>(1, kRowsShare / std::max<int64_t>(row_elements, 1)), f);
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
  for_rows(m, k, [&](int64_t r0, int64_t r1) {
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

// 5. DecodeLayers: decode rows (one new token per row) through whole decoder layers in one call.
//    Between its projections a decode step runs ~30 small torch operators per layer (RMSNorm, RoPE,
//    K/V writes, attention, residual adds, SiLU), most of each one's cost being Python and dispatch:
//    ~7 ms of a ~15 ms SmolLM2 step.  Here the projections are the GEMVs above, RoPE, the residual
//    adds and the K/V writes are loops with the same roundings as torch's bf16 / float32 / fp8
//    operators (one float operation, one round to nearest even), and RMSNorm, attention and SiLU,
//    whose reduction order and exp cannot be reproduced by hand, call the same ATen operators as
//    toolkit/runtime/model.py does, from C++.  So the results are the operator path's bits
//    (tests/test_runtime_fused_decode.py), with "exact" decode batching: one attention call per row
//    over its own context, a row's numbers never depending on the batch.

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion (NaN kept quiet)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// oneDNN's bf16 GEMM over weights it packed (torch.ops.mkldnn._reorder_linear_weight): the call
// model.Projection._library_gemm makes, through the dispatcher as from Python
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct DecodeProjection {
  c10::optional<at::Tensor> packed;    // the bf16 GEMV's weights (pack), for calls of more rows than the codes'
  c10::optional<at::Tensor> codes;     // gemv_q's codes and scales, read for up to codes_max_rows rows
  c10::optional<at::Tensor> scales;
  int64_t kind = 0;
  int64_t codes_max_rows = 0;
  int64_t n = 0;
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> pre_quant_scale;
  int64_t act_kind = 0;
  double act_scale = 0.0;
  // prompt rows (forward_rows), as model.Projection takes them: oneDNN's GEMM over library (its packed bf16
  // weights) or at::linear over dense, calls of fewer than min_rows rows padded with zero rows; own_rounding:
  // the GEMV rounds apart from the library, so one-row prompt calls take the library too; calls of up to
  // whole_gemv_rows rows go through the GEMV whole (model.Projection.whole_gemv_rows); tile_rows > 0 (oneDNN's
  // AMX GEMM): every library call has pad_rows to tile_rows rows, longer ones cut into tiles, the last one padded
  c10::optional<at::Tensor> library, dense;
  int64_t min_rows = 1;
  bool own_rounding = false;
  int64_t whole_gemv_rows = 0;
  int64_t tile_rows = 0, pad_rows = 1;
  // full_rows > 0 (decode_batching "full", no batch invariance): a call goes through the GEMV whole up to full_rows
  // rows and through the library whole beyond, decode rows too (model.Projection.__call__ without singles), so a
  // step with prompt rows reads the weights once where the GEMV rounds apart from the library (AMX hosts)
  int64_t full_rows = 0;
  // gemv_only: the GEMV gives the library's bits for every call (AMX's tiles, model.Projection.library_free) and the
  // library's copy was dropped: the library's calls go through the GEMV
  bool gemv_only = false;

  bool takes_prompt_rows() const { return library.has_value() || dense.has_value() || gemv_only; }

  at::Tensor input(const at::Tensor& x) const {
    if (pre_quant_scale.has_value() || act_kind != 0) return quantize_input(x, pre_quant_scale, act_kind, act_scale);
    return x;
  }

  // model.Projection._gemv: the codes for up to codes_max_rows rows (more in calls of that many where there is no
  // bf16 copy), else the bf16 GEMV
  at::Tensor gemv_rows(const at::Tensor& in) const {
    const int64_t m = in.size(0);
    if (codes.has_value() && (m <= codes_max_rows || !packed.has_value())) {
      if (m <= codes_max_rows) return gemv_q(in, *codes, *scales, kind, n, bias);
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < m; r += codes_max_rows)
        parts.push_back(gemv_q(in.narrow(0, r, std::min(codes_max_rows, m - r)), *codes, *scales, kind, n, bias));
      return at::cat(parts);
    }
    TORCH_CHECK(packed.has_value(), "rtk_kernels.DecodeLayers: more rows than the codes kernel takes, and no bf16 copy");
    return gemv(in, *packed, n, bias);
  }

  // in with zero rows appended up to ``rows`` rows (as model.Projection pads a call)
  static at::Tensor with_zero_rows(const at::Tensor& in, int64_t rows) {
    return in.size(0) >= rows ? in : at::cat({in, at::zeros({rows - in.size(0), in.size(1)}, in.options())});
  }

  // model.Projection._library_gemm
  at::Tensor library_gemm(const at::Tensor& in) const {
    if (gemv_only) return gemv_rows(in);
    if (!library.has_value()) return at::linear(in, *dense, bias);
    const int64_t rows = in.size(0);
    if (tile_rows == 0 || rows == 0 || (pad_rows <= rows && rows <= tile_rows)) return onednn_linear(in, *library, bias);
    const int64_t last = rows % tile_rows;  // a short last tile (or call) is padded to pad_rows
    const at::Tensor x = last > 0 && last < pad_rows ? with_zero_rows(in, rows - last + pad_rows) : in;
    std::vector<at::Tensor> tiles;
    for (int64_t r = 0; r < x.size(0); r += tile_rows)
      tiles.push_back(onednn_linear(x.narrow(0, r, std::min(tile_rows, x.size(0) - r)), *library, bias));
    return at::cat(tiles).narrow(0, 0, rows);
  }

  // model.Projection._padded(_matmul): the library's GEMM (one row through the GEMV where it keeps its bits)
  at::Tensor prompt_rows(const at::Tensor& in) const {
    const int64_t rows = in.size(0);
    if (rows >= min_rows) return rows == 1 && !own_rounding ? gemv_rows(in) : library_gemm(in);
    return library_gemm(with_zero_rows(in, min_rows)).narrow(0, 0, rows);
  }

  // A decode step's rows (all through the GEMV, model.Projection with decode rows only)
  at::Tensor operator()(const at::Tensor& x) const { return gemv_rows(input(x)); }

  // model.Projection.__call__(x, singles=B) for a step whose rows [0, B) decode and the rest are prompt rows
  at::Tensor rows(const at::Tensor& x, int64_t B) const {
    const at::Tensor in = input(x);
    const int64_t m = in.size(0);
    if (full_rows > 0) return m <= full_rows ? gemv_rows(in) : library_gemm(in);  // whatever B: no batch invariance
    if (B == m || m <= whole_gemv_rows) return gemv_rows(in);
    TORCH_CHECK(takes_prompt_rows(), "rtk_kernels.DecodeLayers: prompt rows need the projection's library weights");
    if (whole_gemv_rows > 0) return prompt_rows(in);  // every row's bits are the GEMV's: one GEMM, weights read once
    const at::Tensor prompt = prompt_rows(in.narrow(0, B, m - B));
    return B == 0 ? prompt : at::cat({gemv_rows(in.narrow(0, 0, B)), prompt});
  }
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // bf16 [hidden]
  double k_scale = 1.0, v_scale = 1.0;
  std::vector<DecodeProjection> proj;  // qkv, o, gate_up, down
};

struct DecodeLayers : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, kv_kind;  // kv_kind: 0 bf16, 1 fp8 e4m3 codes, 2 int8
  double eps, scale;
  bool pool_attention = false;  // decode rows through decode_attention.h over the bf16 pool, not gathered + SDPA
  bool sdpa_decode = false;     // gathered rows through sdpa_decode.h (SDPA's bits, one region), not SDPA per row
  at::Tensor cos, sin;  // bf16 [positions, head_dim]; sin signed as model.rope_tables makes it
  std::vector<DecodeLayer> layers;

  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t kv_kind,
               at::Tensor cos, at::Tensor sin)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), kv_kind(kv_kind),
        eps(eps), scale(scale), cos(cos.contiguous()), sin(sin.contiguous()) {
    TORCH_CHECK(this->cos.scalar_type() == at::kBFloat16 && this->sin.scalar_type() == at::kBFloat16 &&
                    this->cos.size(1) == head_dim && head_dim % 2 == 0 && heads % kv_heads == 0,
                "rtk_kernels.DecodeLayers: bf16 rope tables [positions, head_dim], heads a multiple of kv_heads");
  }

  void set_pool_attention(bool on) {
    TORCH_CHECK(!on || kv_kind == 0, "rtk_kernels.DecodeLayers: attention in place reads a bf16 pool");
    pool_attention = on;
  }

  void set_sdpa_decode(bool on) { sdpa_decode = on; }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double k_scale, double v_scale) {
    TORCH_CHECK(input_norm.scalar_type() == at::kBFloat16 && post_norm.scalar_type() == at::kBFloat16,
                "rtk_kernels.DecodeLayers: bf16 norm weights");
    layers.push_back({input_norm.contiguous(), post_norm.contiguous(), k_scale, v_scale, {}});
  }

  // library / dense, min_rows, own_rounding, whole_gemv_rows, tile_rows, pad_rows, full_rows, gemv_only: the
  // projection's prompt rows (DecodeProjection)
  void add_projection(c10::optional<at::Tensor> packed, c10::optional<at::Tensor> codes,
                      c10::optional<at::Tensor> scales, int64_t kind, int64_t codes_max_rows, int64_t n,
                      c10::optional<at::Tensor> bias, c10::optional<at::Tensor> pre_quant_scale, int64_t act_kind,
                      double act_scale, c10::optional<at::Tensor> library, c10::optional<at::Tensor> dense,
                      int64_t min_rows, bool own_rounding, int64_t whole_gemv_rows, int64_t tile_rows,
                      int64_t pad_rows, int64_t full_rows, bool gemv_only) {
    TORCH_CHECK(!layers.empty() && layers.back().proj.size() < 4, "rtk_kernels.DecodeLayers: add_layer first");
    TORCH_CHECK(packed.has_value() || codes.has_value(), "rtk_kernels.DecodeLayers: a projection needs weights");
    TORCH_CHECK(min_rows >= 1, "rtk_kernels.DecodeLayers: min_rows >= 1");
    TORCH_CHECK(full_rows == 0 || library.has_value() || dense.has_value() || gemv_only,
                "rtk_kernels.DecodeLayers: full_rows needs the library's weights");
    TORCH_CHECK(!gemv_only || (!library.has_value() && !dense.has_value() && tile_rows == 0 && !own_rounding),
                "rtk_kernels.DecodeLayers: gemv_only takes no library weights, tiles or own rounding");
    TORCH_CHECK(tile_rows == 0 || (library.has_value() && 1 <= pad_rows && pad_rows <= tile_rows),
                "rtk_kernels.DecodeLayers: tiles need the library's weights and 1 <= pad_rows <= tile_rows");
    TORCH_CHECK(!dense.has_value() || (dense->scalar_type() == at::kBFloat16 && dense->dim() == 2 && dense->size(0) == n),
                "rtk_kernels.DecodeLayers: a projection's dense weights are [out_features, in_features] bf16");
    if (bias.has_value()) bias = bias->contiguous();
    layers.back().proj.push_back({packed, codes, scales, kind, codes_max_rows, n, bias, pre_quant_scale, act_kind,
                                  act_scale, library, dense, min_rows, own_rounding, whole_gemv_rows,
                                  tile_rows, pad_rows, full_rows, gemv_only});
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
    // model.py's (transformers') RMSNorm: torch's rms_norm on float32 (aten/src/ATen/native/layer_norm.cpp,
    // rms_norm_composite: pow(x, 2), mean = sum / k, add eps, rsqrt = 1 / sqrt, times x), to bf16, times
    // the bf16 weight.  Every step is one correctly rounded float operation except the sum, whose
    // vectorized order only ATen's sum reproduces, so that one is ATen's.
    const int64_t m = x.size(0), k = x.size(1);
    const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr());
    auto squares = at::empty({m, k}, at::kFloat);
    float* sq = squares.data_ptr<float>();
    for_rows(m, k, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * k; i < r1 * k; i += 16) {
        const __mmask16 mask = lanes(r1 * k - i);
        const __m512 v = load_bf16(xs + i, mask);
        _mm512_mask_storeu_ps(sq + i, mask, _mm512_mul_ps(v, v));
      }
    });
    auto sums = at::sum(squares, {1}, true);
    const float* ss = sums.data_ptr<float>();
    auto out = at::empty({m, k}, x.options());
    auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float e = static_cast<float>(eps);
    for_rows(m, k, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(ss[r] / static_cast<float>(k) + e));
        for (int64_t c = 0; c < k; c += 16) {
          const __mmask16 mask = lanes(k - c);
          const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16(xs + r * k + c, mask), inv));
          store_bf16(os + r * k + c, mask, _mm512_mul_ps(load_bf16(ws + c, mask), normed));
        }
      }
    });
    return out;
  }

  static void add_into(at::Tensor& h, const at::Tensor& y) {  // h = bf16(h + y), torch's bf16 add
    auto* hs = reinterpret_cast<uint16_t*>(h.data_ptr());
    const auto* ys = reinterpret_cast<const uint16_t*>(y.data_ptr());
    const int64_t k = h.size(1);
    for_rows(h.size(0), k, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * k; i < r1 * k; i += 16) {
        const __mmask16 mask = lanes(r1 * k - i);
        store_bf16(hs + i, mask, _mm512_add_ps(load_bf16(hs + i, mask), load_bf16(ys + i, mask)));
      }
    });
  }

  // RoPE on each row's q and k heads in place, with model.py's bf16 roundings: x * cos + x[swap] * signed sin
  void rope(uint16_t* q, int64_t m, int64_t width, const int64_t* pos) const {
    const int64_t D = head_dim, half = D / 2, heads_rotated = heads + kv_heads;
    const auto* cos_t = reinterpret_cast<const uint16_t*>(cos.data_ptr());
    const auto* sin_t = reinterpret_cast<const uint16_t*>(sin.data_ptr());
    for_rows(m, heads_rotated * D, [&](int64_t r0, int64_t r1) {
      uint16_t out[512];
      for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* c = cos_t + pos[r] * D;
        const uint16_t* s = sin_t + pos[r] * D;
        for (int64_t hd = 0; hd < heads_rotated; ++hd) {
          uint16_t* v = q + r * width + hd * D;
          if (half % 16 == 0) {  // x[swap] of 16 lanes is 16 consecutive elements
            for (int64_t d = 0; d < D; d += 16) {
              const int64_t sw = d < half ? d + half : d - half;
              const __m512 a = round_bf16x16(_mm512_mul_ps(load_bf16(v + d, 0xFFFF), load_bf16(c + d, 0xFFFF)));
              const __m512 b = round_bf16x16(_mm512_mul_ps(load_bf16(v + sw, 0xFFFF), load_bf16(s + d, 0xFFFF)));
              store_bf16(out + d, 0xFFFF, _mm512_add_ps(a, b));
            }
          } else {
            for (int64_t d = 0; d < D; ++d) {
              const float a = round_bf16(bf16_to_float(v[d]) * bf16_to_float(c[d]));
              const float b = round_bf16(bf16_to_float(v[(d + half) % D]) * bf16_to_float(s[d]));
              out[d] = float_to_bf16(a + b);
            }
          }
          std::memcpy(v, out, D * 2);
        }
      }
    });
  }

  // SiLU(gate) * up on gate_up's rows [gate | up]: torch's SiLU (its exp), then the bf16 product
  static at::Tensor silu_times_up(const at::Tensor& gu) {
    const int64_t m = gu.size(0), inter = gu.size(1) / 2;
    auto act = at::empty({m, inter}, gu.options());
    auto* ac = reinterpret_cast<uint16_t*>(act.data_ptr());
    const auto* up = reinterpret_cast<const uint16_t*>(gu.data_ptr()) + inter;
    const bool inference = c10::InferenceMode::is_enabled();  // the pool's workers do not inherit the caller's
    for_rows(m, inter, [&](int64_t r0, int64_t r1) {
      const c10::InferenceMode mode(inference);
      at::Tensor part = act.narrow(0, r0, r1 - r0);  // torch's SiLU row by row (its exp), on both threads
      at::silu_out(part, gu.narrow(0, r0, r1 - r0).narrow(1, 0, inter));
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < inter; i += 16) {
          const __mmask16 mask = lanes(inter - i);
          uint16_t* a = ac + r * inter + i;
          store_bf16(a, mask, _mm512_mul_ps(load_bf16(a, mask), load_bf16(up + r * 2 * inter + i, mask)));
        }
    });
    return act;
  }

  inline void store_kv(void* pool, int64_t slot, const uint16_t* src, double kv_scale) const {
    const int64_t row = kv_heads * head_dim;
    if (kv_kind == 0) {
      std::memcpy(static_cast<uint16_t*>(pool) + slot * row, src, row * 2);
      return;
    }
    auto* dst = static_cast<uint8_t*>(pool) + slot * row;
    const float s = static_cast<float>(kv_scale);
    for (int64_t i = 0; i < row; ++i) {  // KVPool._encode: float32 x / scale, then fp8 (nearest even) or int8
      const float q = bf16_to_float(src[i]) / s;
      if (kv_kind == 1) {
        dst[i] = c10::Float8_e4m3fn(std::min(std::max(q, -448.0f), 448.0f)).x;
      } else {
        const float r = std::min(std::max(std::nearbyint(q), -128.0f), 127.0f);
        dst[i] = static_cast<uint8_t>(static_cast<int8_t>(r));
      }
    }
  }

  // K or V at the given slots as float32 [count, kv_heads, head_dim], as KVPool.gather gives them (bf16
  // exactly widened; codes as float32(code) * scale)
  at::Tensor gather(const void* pool, const int64_t* slots, int64_t count, double kv_scale) const {
    const int64_t row = kv_heads * head_dim;
    auto out = at::empty({count, kv_heads, head_dim}, at::kFloat);
    float* o = out.data_ptr<float>();
    float table[256];  // a code's float32 value times the scale, one multiplication as KVPool._decode does
    if (kv_kind != 0) {
      const float s = static_cast<float>(kv_scale);
      for (int c = 0; c < 256; ++c) {
        const uint8_t b = static_cast<uint8_t>(c);
        const float v = kv_kind == 1 ? static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()))
                                     : static_cast<float>(static_cast<int8_t>(b));
        table[c] = v * s;
      }
    }
    at::parallel_for(0, count, std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)), [&](int64_t a, int64_t b) {
      for (int64_t j = a; j < b; ++j) {
        float* dst = o + j * row;
        if (kv_kind == 0) {
          const auto* src = static_cast<const uint16_t*>(pool) + slots[j] * row;
          for (int64_t i = 0; i < row; ++i) dst[i] = bf16_to_float(src[i]);
        } else {
          const auto* src = static_cast<const uint8_t*>(pool) + slots[j] * row;
          for (int64_t i = 0; i < row; ++i) dst[i] = table[src[i]];
        }
      }
    });
    return out;
  }

  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor write_slots, at::Tensor ctx_slots,
                     at::Tensor ctx_bounds, at::Tensor k_pool, at::Tensor v_pool, int64_t begin, int64_t end,
                     c10::optional<at::Tensor> padded_slots, c10::optional<at::Tensor> padded_mask) {
    const int64_t m = h.size(0);
    check_pools(h, k_pool, v_pool);
    at::Tensor padded = check_decode_plan("rtk_kernels.DecodeLayers", m, positions, write_slots, ctx_slots, ctx_bounds,
                                          k_pool, begin, end, static_cast<int64_t>(layers.size()), cos.size(0),
                                          padded_slots, padded_mask);
    return run(h, m, positions, write_slots, ctx_slots, ctx_bounds, k_pool, v_pool, begin, end, padded, padded_mask,
               {});
  }

  // A step with prompt rows: rows [0, num_decode) decode as forward's rows do (with padded_slots / padded_mask,
  // those rows' padded plan), the rest are prompt chunks (decode_plan.h, PromptPlan).  Each projection takes
  // the decode rows through the GEMV and the prompt rows through oneDNN's GEMM, or every row through the GEMV or
  // the GEMM where that gives the decode rows the GEMV's bits (DecodeProjection::rows), as model.Projection splits
  // a call; the prompt rows attend through torch's SDPA per unit as model.py calls it: so every row's numbers are
  // the operator path's (model.Transformer._layers).
  at::Tensor forward_rows(at::Tensor h, int64_t num_decode, at::Tensor positions, at::Tensor write_slots,
                          at::Tensor ctx_slots, at::Tensor ctx_bounds, at::Tensor k_pool, at::Tensor v_pool,
                          int64_t begin, int64_t end, c10::optional<at::Tensor> padded_slots,
                          c10::optional<at::Tensor> padded_mask, at::Tensor chunks, std::vector<at::Tensor> chunk_slots,
                          at::Tensor units, std::vector<at::Tensor> unit_masks) {
    const char* who = "rtk_kernels.DecodeLayers.forward_rows";
    const int64_t m = h.size(0), B = num_decode;
    check_pools(h, k_pool, v_pool);
    for (const DecodeLayer& layer : layers)
      for (const DecodeProjection& p : layer.proj)
        TORCH_CHECK(p.takes_prompt_rows(), who, ": prompt rows need every projection's library weights");
    const PromptStep step = check_prompt_step(who, m, B, positions, write_slots, ctx_slots, ctx_bounds, k_pool, begin,
                                              end, static_cast<int64_t>(layers.size()), cos.size(0), chunks,
                                              std::move(chunk_slots), units, std::move(unit_masks), padded_slots,
                                              padded_mask);
    return run(h, B, positions, write_slots, ctx_slots, ctx_bounds, k_pool, v_pool, begin, end, step.padded,
               padded_mask, step.prompts);
  }

 private:
  void check_pools(const at::Tensor& h, const at::Tensor& k_pool, const at::Tensor& v_pool) const {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2, "rtk_kernels.DecodeLayers: h is [rows, hidden] bf16");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4 && k_pool.size(2) == kv_heads &&
                    k_pool.size(3) == head_dim && k_pool.element_size() == (kv_kind == 0 ? 2 : 1) &&
                    v_pool.sizes() == k_pool.sizes() && v_pool.element_size() == k_pool.element_size(),
                "rtk_kernels.DecodeLayers: K/V pools [layers, slots, kv_heads, head_dim] of the pool's dtype");
  }

  // The layers over all rows of h: decode rows [0, B) attend as forward describes, prompt rows (if any) by chunk
  // and unit through torch's SDPA (prompt_attention).
  at::Tensor run(at::Tensor h, int64_t B, const at::Tensor& positions, const at::Tensor& write_slots,
                 const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, int64_t begin, int64_t end, const at::Tensor& padded,
                 const c10::optional<at::Tensor>& padded_mask, const PromptPlan& prompts) {
    const int64_t m = h.size(0), H = heads, KVH = kv_heads, D = head_dim;
    const bool batched = padded.defined();
    const int64_t slots = k_pool.size(1);
    const auto* pos = positions.data_ptr<int64_t>();
    const auto* ws = write_slots.data_ptr<int64_t>();
    const auto* cs = ctx_slots.data_ptr<int64_t>();
    const auto* cb = ctx_bounds.data_ptr<int64_t>();
    h = h.contiguous().clone();
    const int64_t layer_slots = slots * KVH * D;
    const int64_t kv_elt = k_pool.element_size();
    for (int64_t li = begin; li < end; ++li) {
      const DecodeLayer& layer = layers[li];
      auto qkv = layer.proj[0].rows(rms_norm(h, layer.input_norm), B);  // [m, (H + 2 KVH) D]
      auto* q = reinterpret_cast<uint16_t*>(qkv.data_ptr());
      const int64_t width = (H + 2 * KVH) * D;
      rope(q, m, width, pos);
      char* kp = static_cast<char*>(k_pool.data_ptr()) + li * layer_slots * kv_elt;
      char* vp = static_cast<char*>(v_pool.data_ptr()) + li * layer_slots * kv_elt;
      for (int64_t r = 0; r < m; ++r) {
        store_kv(kp, ws[r], q + r * width + H * D, layer.k_scale);
        store_kv(vp, ws[r], q + r * width + (H + KVH) * D, layer.v_scale);
      }
      // attention: with pool_attention decode_attention.h over each row's context where it lies (model.py's
      // operators call the same code); with sdpa_decode every row over its own gathered context with the bits of
      // torch's SDPA called for that row alone (sdpa_decode.h), in one call; else torch's SDPA on float32 q/k/v
      // as model.py calls it: one call per row over its own context ("exact" decode batching, transformers' call
      // for a lone decode), or with padded_slots one masked call over every row's context padded to the longest
      // ("attention" decode batching).  Prompt rows: prompt_attention.
      auto qf = qkv.narrow(1, 0, H * D).to(at::kFloat).contiguous().view({m, H, D});
      std::vector<at::Tensor> outs;
      outs.reserve(B + 1);
      const at::Tensor qd = qf.narrow(0, 0, B);
      if (B > 0 && batched && !pool_attention && !sdpa_decode) {  // (else the padded plan is checked, not read)
        const int64_t len = padded.size(1);
        auto k = gather(kp, padded.data_ptr<int64_t>(), B * len, layer.k_scale).view({B, len, KVH, D}).transpose(1, 2);
        auto v = gather(vp, padded.data_ptr<int64_t>(), B * len, layer.v_scale).view({B, len, KVH, D}).transpose(1, 2);
        auto o = at::scaled_dot_product_attention(qd.view({B, H, 1, D}), k, v, padded_mask, 0.0, false, scale,
                                                  KVH != H);
        outs.push_back(o.view({B, H * D}));
      }
      if (B > 0 && pool_attention) {  // every row over its own context where it lies in the bf16 pool
        auto o = at::empty({B, H * D}, at::kFloat);
        const auto* kb = reinterpret_cast<const uint16_t*>(kp);
        const auto* vb = reinterpret_cast<const uint16_t*>(vp);
        rtk_attention::decode_attention_rows(qd.data_ptr<float>(), H * D, D, kb, vb, cs, cb, B, H, KVH, D,
                                             static_cast<float>(scale), o.data_ptr<float>());
        outs.push_back(o);
      }
      if (B > 0 && sdpa_decode && !pool_attention) {  // SDPA's bits for every row in one call (sdpa_decode.h)
        const char* who = "rtk_kernels.DecodeLayers";
        if (kv_kind == 0) {  // each row's context read from the bf16 pool by the thread that attends it
          auto pool_k = k_pool.select(0, li), pool_v = v_pool.select(0, li);
          outs.push_back(rtk_sdpa::decode(who, qd, pool_k, pool_v, ctx_slots, ctx_bounds, scale));
        } else {  // codes: every row's context decoded as KVPool.gather does
          const int64_t count = ctx_slots.numel();
          auto k = gather(kp, cs, count, layer.k_scale), v = gather(vp, cs, count, layer.v_scale);
          outs.push_back(rtk_sdpa::decode(who, qd, k, v, c10::nullopt, ctx_bounds, scale));
        }
      }
      for (int64_t r = 0; r < B && !batched && !pool_attention && !sdpa_decode; ++r) {
        const int64_t count = cb[2 * r + 1] - cb[2 * r];
        auto k = gather(kp, cs + cb[2 * r], count, layer.k_scale).transpose(0, 1).unsqueeze(0);
        auto v = gather(vp, cs + cb[2 * r], count, layer.v_scale).transpose(0, 1).unsqueeze(0);
        auto o = at::scaled_dot_product_attention(qf[r].view({1, H, 1, D}), k, v, c10::nullopt, 0.0, false, scale,
                                                  KVH != H);
        outs.push_back(o.view({1, H * D}));
      }
      if (B < m) outs.push_back(prompt_attention(qf, qkv, B, kp, vp, layer, prompts));
      auto attn = (outs.size() == 1 ? outs[0] : at::cat(outs)).to(at::kBFloat16);
      add_into(h, layer.proj[1].rows(attn, B));
      auto gu = layer.proj[2].rows(rms_norm(h, layer.post_norm), B);
      add_into(h, layer.proj[3].rows(silu_times_up(gu), B));
    }
    return h;
  }

  // Prompt rows' attention, float32 [m - B, H * D], with the views, conversions and SDPA calls of
  // model.Transformer._layers: q the rotated q heads widened, a chunk's keys its own rotated k heads and v (from
  // the qkv rows, widened) or the pool's at its slots as KVPool.gather gives them.
  at::Tensor prompt_attention(const at::Tensor& qf, const at::Tensor& qkv, int64_t B, const char* kp, const char* vp,
                              const DecodeLayer& layer, const PromptPlan& p) const {
    const int64_t H = heads, KVH = kv_heads, D = head_dim, m = qkv.size(0);
    const bool gqa = KVH != H;
    const at::Tensor k = qkv.narrow(1, H * D, KVH * D).view({m, KVH, D});
    const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({m, KVH, D});
    auto attn = at::empty({m - B, H * D}, at::kFloat);
    const auto* ch = p.chunks.data_ptr<int64_t>();
    int64_t u = 0;
    for (int64_t c = 0; c < p.chunks.size(0); ++c) {
      const int64_t start = ch[3 * c], len = ch[3 * c + 1];
      at::Tensor kc, vc;
      if (p.chunk_slots[c].numel() == 0) {
        kc = k.narrow(0, start, len).transpose(0, 1).unsqueeze(0).to(at::kFloat);
        vc = v.narrow(0, start, len).transpose(0, 1).unsqueeze(0).to(at::kFloat);
      } else {
        const at::Tensor& sl = p.chunk_slots[c];
        kc = gather(kp, sl.data_ptr<int64_t>(), sl.numel(), layer.k_scale).transpose(0, 1).unsqueeze(0);
        vc = gather(vp, sl.data_ptr<int64_t>(), sl.numel(), layer.v_scale).transpose(0, 1).unsqueeze(0);
      }
      const at::Tensor qc = qf.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
      u = attend_units(p, c, u, qc, kc, vc, scale, gqa, attn, start - B);
    }
    return attn;
  }
};

// 6. decode_attention: a bf16 engine's decode rows over a bf16 (or float32) pool, read in place
// (decode_attention.h); model.py's operator path calls it where the fused step does, for the same bits.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds, double scale) {
  return rtk_attention::decode_attention("rtk_kernels.decode_attention", q, k_pool, v_pool, ctx_slots, ctx_bounds,
                                         scale);
}

// 7. sdpa_decode: torch's SDPA for decode rows over their contexts (gathered, or read from the pool at their
// slots), its bits in one call (sdpa_decode.h); model.py's operator path calls it where the fused step does.
at::Tensor sdpa_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& slots, const at::Tensor& bounds, double scale) {
  return rtk_sdpa::decode("rtk_kernels.sdpa_decode", q, k, v, slots, bounds, scale);
}

}  // namespace

TORCH_LIBRARY(rtk_kernels, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor, at::Tensor>())
      .def("set_pool_attention", &DecodeLayers::set_pool_attention)
      .def("set_sdpa_decode", &DecodeLayers::set_sdpa_decode)
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_projection", &DecodeLayers::add_projection)
      .def("forward", &DecodeLayers::forward)
      .def("forward_rows", &DecodeLayers::forward_rows);
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("argmax_rows(Tensor x) -> Tensor", &rtk_argmax::argmax_rows);
  m.def("gemv(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &gemv);
  m.def("set_gemv_tiles(bool on) -> bool", &set_gemv_tiles);
  m.def("pack_q(Tensor codes, int kind) -> Tensor", &pack_q);
  m.def("pack_scales(Tensor scale) -> Tensor", &pack_scales);
  m.def("gemv_q(Tensor x, Tensor codes, Tensor scales, int kind, int n, Tensor? bias) -> Tensor", &gemv_q);
  m.def("unpack_q(Tensor codes, Tensor scales, int kind, int n) -> Tensor", &unpack_q);
  m.def("pack_group_scales(Tensor scale) -> Tensor", &pack_group_scales);
  m.def("fp8_tables(Tensor block_scales) -> Tensor", &fp8_tables);
  m.def("quantize_input(Tensor x, Tensor? pre_quant_scale, int act_kind, float act_scale) -> Tensor", &quantize_input);
  m.def("gather_kv(Tensor k, Tensor v, Tensor slots) -> Tensor[]", &gather_kv);
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor ctx_slots, Tensor ctx_bounds, float scale) "
        "-> Tensor",
        &decode_attention);
  m.def("sdpa_decode(Tensor q, Tensor k, Tensor v, Tensor? slots, Tensor bounds, float scale) -> Tensor", &sdpa_decode);
}
