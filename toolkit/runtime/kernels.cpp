// rtk's CPU kernels for the decode step (CPUs with AVX512-BF16), each bit-identical to what it replaces
// (1. gemv, 2. gather_kv below).
//
// 1. gemv: bf16 matmul of a few rows (the decode GEMV, y = x W^T [+ b]).
// oneDNN's one-row bf16 kernel (brg_matmul:avx512_core_bf16) reads weights at well below the
// machine's bandwidth here; this kernel streams them.  It computes every output with the same
// arithmetic as oneDNN's kernel, so its results are bit-identical (toolkit/runtime/gemv.py checks
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

// Rows [r0, r0 + R) of x times one 64-output block: every row with the one-row arithmetic above.
// The block's chunk of weights is read from memory once and from cache for the other rows.
template <int R>
inline void block_rows(const uint32_t* xs, int64_t r0, const uint16_t* base, int64_t pairs, float* total) {
  for (int64_t k0 = 0; k0 < pairs; k0 += kChunkPairs) {
    const int64_t k1 = std::min(pairs, k0 + kChunkPairs);
    __m512 p[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) p[r][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const uint16_t* row = base + k * kBlock * 2;
      const __m512i w0 = _mm512_loadu_si512(row), w1 = _mm512_loadu_si512(row + 32);
      const __m512i w2 = _mm512_loadu_si512(row + 64), w3 = _mm512_loadu_si512(row + 96);
      for (int r = 0; r < R; ++r) {
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[(r0 + r) * pairs + k]));
        p[r][0] = _mm512_dpbf16_ps(p[r][0], xk, (__m512bh)w0);
        p[r][1] = _mm512_dpbf16_ps(p[r][1], xk, (__m512bh)w1);
        p[r][2] = _mm512_dpbf16_ps(p[r][2], xk, (__m512bh)w2);
        p[r][3] = _mm512_dpbf16_ps(p[r][3], xk, (__m512bh)w3);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) {
        float* t = total + (r * 4 + j) * 16;
        _mm512_storeu_ps(t, k0 == 0 ? p[r][j] : _mm512_add_ps(_mm512_loadu_ps(t), p[r][j]));
      }
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "rtk_kernels.gemv: x is [M, K] bf16");
  const int64_t blocks = packed.size(0), pairs = packed.size(1), m = x.size(0);
  TORCH_CHECK(x.size(1) == 2 * pairs && n <= blocks * kBlock, "rtk_kernels.gemv: shapes do not match");
  auto xc = x.contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  const auto* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bs = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float total[4 * kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* base = ws + b * pairs * kBlock * 2;
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, m - r0));
        switch (rows) {
          case 4: block_rows<4>(xs, r0, base, pairs, total); break;
          case 3: block_rows<3>(xs, r0, base, pairs, total); break;
          case 2: block_rows<2>(xs, r0, base, pairs, total); break;
          default: block_rows<1>(xs, r0, base, pairs, total); break;
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

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 2. gather_kv: K and V rows of the paged cache at the given slots, bf16 -> float32 in one pass
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
  m.def("gather_kv(Tensor k, Tensor v, Tensor slots) -> Tensor[]", &gather_kv);
}
