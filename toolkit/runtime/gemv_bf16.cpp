// One-row bf16 matmul (the decode GEMV, y = x W^T [+ b]) for CPUs with AVX512-BF16.
//
// oneDNN's one-row bf16 kernel (brg_matmul:avx512_core_bf16) reads weights at well below the
// machine's bandwidth here; this kernel streams them.  It computes every output with the same
// arithmetic as oneDNN's kernel, so its results are bit-identical (toolkit/runtime/gemv.py checks
// that at load for every weight shape and uses the kernel only where it holds):
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
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 64;       // outputs per block: 4 zmm accumulators
constexpr int64_t kChunkPairs = 256;  // reduction chunk (pairs), as oneDNN's kernel blocks it

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "rtk_gemv.pack: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "rtk_gemv.pack: in_features must be even");
  const int64_t padded = (n + kBlock - 1) / kBlock * kBlock;
  auto w = at::zeros({padded, k}, weight.options());
  w.narrow(0, 0, n).copy_(weight);
  return w.view({padded / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16, "rtk_gemv.gemv: x is [1, K] bf16");
  const int64_t blocks = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(x.size(1) == 2 * pairs && n <= blocks * kBlock, "rtk_gemv.gemv: shapes do not match");
  auto xc = x.contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  auto y = at::empty({1, n}, x.options());
  const auto* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bs = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* base = ws + b * pairs * kBlock * 2;
      __m512 acc[4];
      for (int64_t k0 = 0; k0 < pairs; k0 += kChunkPairs) {
        const int64_t k1 = std::min(pairs, k0 + kChunkPairs);
        __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
        for (int64_t k = k0; k < k1; ++k) {
          const uint16_t* row = base + k * kBlock * 2;
          const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[k]));
          p0 = _mm512_dpbf16_ps(p0, xk, (__m512bh)_mm512_loadu_si512(row));
          p1 = _mm512_dpbf16_ps(p1, xk, (__m512bh)_mm512_loadu_si512(row + 32));
          p2 = _mm512_dpbf16_ps(p2, xk, (__m512bh)_mm512_loadu_si512(row + 64));
          p3 = _mm512_dpbf16_ps(p3, xk, (__m512bh)_mm512_loadu_si512(row + 96));
        }
        if (k0 == 0) {
          acc[0] = p0, acc[1] = p1, acc[2] = p2, acc[3] = p3;
        } else {
          acc[0] = _mm512_add_ps(acc[0], p0), acc[1] = _mm512_add_ps(acc[1], p1);
          acc[2] = _mm512_add_ps(acc[2], p2), acc[3] = _mm512_add_ps(acc[3], p3);
        }
      }
      for (int j = 0; j < 4; ++j) {
        const int64_t first = b * kBlock + j * 16;
        if (first >= n) break;
        const int64_t count = std::min<int64_t>(16, n - first);
        const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
        __m512 v = acc[j];
        if (bs) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bs + first));
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(ys + first, mask, r);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(rtk_gemv, m) {
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("gemv(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor", &gemv);
}
