// argmax_rows: each row's index of its largest value, as torch.argmax(x, dim=-1) gives it (the first of equal
// largest values; a NaN counts as the largest, so the first NaN), for the greedy tokens of a step's logits.
// torch's CPU argmax compares element by element (~2 ns an element: 0.1 ms a row of SmolLM2's 49,152 logits, 0.4-0.8
// ms a step at 8 streams); here a vector max over the row, then the first index holding it (a few us a row).
// Shared by both kernel libraries (kernels.cpp, kernels_avx2.cpp); AVX2 only.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace rtk_argmax {

inline int64_t argmax_row(const float* x, int64_t n) {
  __m256 largest = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    largest = _mm256_max_ps(largest, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  float best = -INFINITY;
  for (float l : lanes) best = l > best ? l : best;
  for (int64_t j = i; j < n; ++j) nan |= std::isnan(x[j]), best = x[j] > best ? x[j] : best;
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

// x float32 [B, V] (V > 0) -> int64 [B]; one thread (a step has at most a few rows, each a few microseconds)
inline at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x is [B, V>0] float32");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xs = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(xs + r * n, n);
  return out;
}

}  // namespace rtk_argmax
