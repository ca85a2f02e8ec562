// The checks of a decode step's plan that rtk's two DecodeLayers (kernels.cpp, kernels_avx2.cpp) share:
// positions, write slots, context slots and bounds, the layer range and the padded contexts of batched
// attention.  kernels.build_dir hashes this header with each source that includes it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// ``who`` names the op in messages; ``positions_max`` is the RoPE tables' length, ``layers`` the model's.
// Returns the padded context slots, contiguous, where attention is batched (else an undefined tensor).
inline at::Tensor check_decode_plan(const char* who, int64_t m, const at::Tensor& positions,
                                    const at::Tensor& write_slots, const at::Tensor& ctx_slots,
                                    const at::Tensor& ctx_bounds, const at::Tensor& k_pool, int64_t begin,
                                    int64_t end, int64_t layers, int64_t positions_max,
                                    const c10::optional<at::Tensor>& padded_slots,
                                    const c10::optional<at::Tensor>& padded_mask) {
  TORCH_CHECK(positions.numel() == m && write_slots.numel() == m && ctx_bounds.size(0) == m &&
                  ctx_bounds.size(1) == 2 && positions.scalar_type() == at::kLong &&
                  write_slots.scalar_type() == at::kLong && ctx_slots.scalar_type() == at::kLong &&
                  ctx_bounds.scalar_type() == at::kLong,
              who, ": int64 positions, write_slots [rows], ctx_slots, ctx_bounds [rows, 2]");
  TORCH_CHECK(0 <= begin && begin <= end && end <= layers && end <= k_pool.size(0), who, ": layer range");
  const int64_t slots = k_pool.size(1);
  const auto* pos = positions.data_ptr<int64_t>();
  const auto* ws = write_slots.data_ptr<int64_t>();
  const auto* cs = ctx_slots.data_ptr<int64_t>();
  const auto* cb = ctx_bounds.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < positions_max && ws[r] >= 0 && ws[r] < slots && 0 <= cb[2 * r] &&
                    cb[2 * r] < cb[2 * r + 1] && cb[2 * r + 1] <= ctx_slots.numel(),
                who, ": a position, slot or context bound is out of range");
    for (int64_t j = cb[2 * r]; j < cb[2 * r + 1]; ++j)
      TORCH_CHECK(cs[j] >= 0 && cs[j] < slots, who, ": context slot out of range");
  }
  at::Tensor padded;
  if (padded_slots.has_value()) {
    padded = padded_slots->contiguous();
    TORCH_CHECK(padded.scalar_type() == at::kLong && padded.dim() == 2 && padded.size(0) == m &&
                    padded_mask.has_value() && padded_mask->size(0) == m && padded_mask->size(-1) == padded.size(1),
                who, ": padded slots [rows, L] int64 with their mask [rows, 1, 1, L]");
    const auto* ps = padded.data_ptr<int64_t>();
    for (int64_t j = 0; j < padded.numel(); ++j)
      TORCH_CHECK(ps[j] >= 0 && ps[j] < slots, who, ": context slot out of range");
  }
  return padded;
}
