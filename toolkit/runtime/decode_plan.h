// The checks of a step's plan that rtk's two DecodeLayers (kernels.cpp, kernels_avx2.cpp) share:
// positions, write slots, context slots and bounds, the layer range and the padded contexts of batched
// attention (check_decode_plan), and a step's prompt chunks and attention units (check_prompt_plan).
// kernels.build_dir hashes this header with each source that includes it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

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

// A step's prompt rows (DecodeLayers.forward_rows): rows from num_decode on are prompt chunks, chunks [C, 3] =
// (first row, rows, positions already cached) in row order, each reading its keys from chunk_slots[c] (the
// cached positions and its own, in order) or, where that is empty, from its own rows (a chunk at position 0).
// Their attention is model.py's (Transformer._layers): one torch SDPA call per unit of query rows, units [U, 3]
// = (chunk, first query row, end) with unit_masks[u] [rows, cached + end] bool.
struct PromptPlan {
  at::Tensor chunks, units;
  std::vector<at::Tensor> chunk_slots, unit_masks;
};

// Checks every prompt row's position and write slot (rows [num_decode, m)), that the chunks cover those rows
// in order, their slots, and that the units cover each chunk's rows in order with masks of their shape.
inline PromptPlan check_prompt_plan(const char* who, int64_t m, int64_t num_decode, const at::Tensor& positions,
                                    const at::Tensor& write_slots, int64_t slots, int64_t positions_max,
                                    const at::Tensor& chunks_in, std::vector<at::Tensor> chunk_slots,
                                    const at::Tensor& units_in, std::vector<at::Tensor> unit_masks) {
  const int64_t B = num_decode;
  TORCH_CHECK(positions.is_contiguous() && write_slots.is_contiguous() && 0 <= B && B <= m &&
                  positions.numel() == m && write_slots.numel() == m && positions.scalar_type() == at::kLong &&
                  write_slots.scalar_type() == at::kLong,
              who, ": int64 positions and write_slots [rows], num_decode <= rows");
  const auto* pos = positions.data_ptr<int64_t>();
  const auto* ws = write_slots.data_ptr<int64_t>();
  for (int64_t r = B; r < m; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < positions_max && ws[r] >= 0 && ws[r] < slots, who,
                ": a position or slot is out of range");
  const at::Tensor chunks = chunks_in.contiguous(), units = units_in.contiguous();
  TORCH_CHECK(chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 3 &&
                  units.scalar_type() == at::kLong && units.dim() == 2 && units.size(1) == 3 &&
                  static_cast<int64_t>(chunk_slots.size()) == chunks.size(0) &&
                  static_cast<int64_t>(unit_masks.size()) == units.size(0),
              who, ": chunks [C, 3] and units [U, 3] int64, a slots tensor per chunk and a mask per unit");
  const auto* ch = chunks.data_ptr<int64_t>();
  int64_t next_row = B;
  for (int64_t c = 0; c < chunks.size(0); ++c) {
    const int64_t start = ch[3 * c], len = ch[3 * c + 1], cached = ch[3 * c + 2];
    TORCH_CHECK(start == next_row && len > 0 && cached >= 0, who, ": chunks must cover the prompt rows in order");
    next_row = start + len;
    const at::Tensor& cs = chunk_slots[c];
    TORCH_CHECK(cs.numel() == 0 ? cached == 0 : (cs.scalar_type() == at::kLong && cs.numel() == cached + len), who,
                ": a chunk reads cached + rows slots, or its own rows from position 0");
    if (cs.numel()) {
      chunk_slots[c] = cs.contiguous();
      const auto* sp = chunk_slots[c].data_ptr<int64_t>();
      for (int64_t j = 0; j < cs.numel(); ++j) TORCH_CHECK(sp[j] >= 0 && sp[j] < slots, who, ": slot out of range");
    }
  }
  TORCH_CHECK(next_row == m, who, ": chunks must cover the prompt rows in order");
  const auto* un = units.data_ptr<int64_t>();
  TORCH_CHECK(units.size(0) == 0 || chunks.size(0) > 0, who, ": units need their chunks");
  int64_t chunk = 0, row = 0;  // units cover each chunk's rows in order, chunk after chunk
  for (int64_t u = 0; u < units.size(0); ++u) {
    const int64_t c = un[3 * u], a = un[3 * u + 1], b = un[3 * u + 2];
    if (c == chunk + 1 && row == ch[3 * chunk + 1]) chunk = c, row = 0;
    TORCH_CHECK(c == chunk && a == row && a < b && b <= ch[3 * c + 1], who,
                ": units must cover each chunk's rows in order");
    row = b;
    const at::Tensor& mask = unit_masks[u];
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == b - a &&
                    mask.size(1) == ch[3 * c + 2] + b,
                who, ": a unit's mask is [rows, cached + end] bool");
  }
  TORCH_CHECK(chunks.size(0) == 0 || (chunk == chunks.size(0) - 1 && row == ch[3 * chunk + 1]), who,
              ": units must cover each chunk's rows in order");
  return {chunks, units, std::move(chunk_slots), std::move(unit_masks)};
}

// A step with prompt rows (DecodeLayers.forward_rows): positions and write slots made contiguous, the prompt
// plan checked (check_prompt_plan), then the decode rows' plan (check_decode_plan; their padded contexts where
// given).  Returns the prompt plan and the padded slots (undefined where attention is not batched).
struct PromptStep {
  PromptPlan prompts;
  at::Tensor padded;
};

inline PromptStep check_prompt_step(const char* who, int64_t m, int64_t num_decode, at::Tensor& positions,
                                    at::Tensor& write_slots, const at::Tensor& ctx_slots, const at::Tensor& ctx_bounds,
                                    const at::Tensor& k_pool, int64_t begin, int64_t end, int64_t layers,
                                    int64_t positions_max, const at::Tensor& chunks, std::vector<at::Tensor> chunk_slots,
                                    const at::Tensor& units, std::vector<at::Tensor> unit_masks,
                                    const c10::optional<at::Tensor>& padded_slots,
                                    const c10::optional<at::Tensor>& padded_mask) {
  const int64_t B = num_decode;
  positions = positions.contiguous();
  write_slots = write_slots.contiguous();
  PromptPlan prompts = check_prompt_plan(who, m, B, positions, write_slots, k_pool.size(1), positions_max, chunks,
                                         std::move(chunk_slots), units, std::move(unit_masks));
  at::Tensor padded = check_decode_plan(who, B, positions.narrow(0, 0, B), write_slots.narrow(0, 0, B), ctx_slots,
                                        ctx_bounds, k_pool, begin, end, layers, positions_max, padded_slots,
                                        padded_mask);
  return {std::move(prompts), padded};
}

// Chunk c's attention units (from unit u on) as model.Transformer._layers calls them: one torch SDPA per unit over
// the chunk's queries qc and keys / values kc, vc ([1, heads, rows, head_dim] views), each unit's rows copied into
// attn ([rows, heads * head_dim], the chunk's first row at attn_row).  Returns the first unit of the next chunk.
inline int64_t attend_units(const PromptPlan& p, int64_t c, int64_t u, const at::Tensor& qc, const at::Tensor& kc,
                            const at::Tensor& vc, double scale, bool gqa, at::Tensor& attn, int64_t attn_row) {
  const auto* ch = p.chunks.data_ptr<int64_t>();
  const auto* un = p.units.data_ptr<int64_t>();
  const int64_t cached = ch[3 * c + 2], width = attn.size(1);
  for (; u < p.units.size(0) && un[3 * u] == c; ++u) {
    const int64_t a = un[3 * u + 1], b = un[3 * u + 2], keys = cached + b;
    const at::Tensor o = at::scaled_dot_product_attention(qc.narrow(2, a, b - a), kc.narrow(2, 0, keys),
                                                          vc.narrow(2, 0, keys), p.unit_masks[u], 0.0, false, scale, gqa);
    attn.narrow(0, attn_row + a, b - a).copy_(o[0].transpose(0, 1).reshape({b - a, width}));
  }
  return u;
}
