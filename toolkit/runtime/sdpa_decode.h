// Torch's scaled_dot_product_attention for decode rows (one query per sequence, no mask), float32, bit for bit,
// without its per-call costs.  kernels.cpp (the bf16 engines' library) compiles it; kernels.build_dir hashes
// this header with it.
//
// For such a call on a CPU torch runs its flash-attention kernel (aten/src/ATen/native/cpu/
// FlashAttentionKernel.cpp, cpu_flash_attention, pytorch/pytorch v2.13.0): per query head, q . k for a block of
// up to 512 keys by BLAS sgemm, times the scale, the block's max, exp_u20 of each score less the max summed in
// 16 lanes (the tail one by one), the block's sum folded into the running one, p . v by sgemm, and at the end
// the output times 1 / sum.  Each call also allocates its buffers, dispatches, spawns an OpenMP region over
// the heads and is given a gathered copy of the context: ~16 us a call at 66 keys against ~8 us for the
// arithmetic (Zen 4, 2 threads), once per decode row and layer.  Here every row and head of a step go
// through one call (an OpenMP region only where the contexts are long), each row's context read from the
// pool by the thread that attends it, with the same arithmetic in the same order:
//   * the same sgemm_ calls (torch's cpublas::gemm for float: normalize_last_dims, then the BLAS it was built
//     with; MKL in the x86 wheels), the same scalar and 16-lane vector code (ATen's Vectorized<float> for
//     AVX512, compiled with CPU_CAPABILITY_AVX512 as torch compiles its AVX512 kernels), and two things its
//     source does not show but its binary does (found by comparing bits): the tail's exp is C's double exp
//     (an unqualified exp of a float there), and the running sum's update sum + rescale * running is one
//     fused multiply-add;
//   * the buffers at torch's offsets: MKL's sgemm treats an output that does not start on a 64-byte boundary
//     apart (its first elements rounded another way), and torch's buffer for OpenMP thread t starts at
//     t * (keys + 2 + head_dim) floats of a 64-byte aligned allocation, t being the thread torch's
//     parallel_for would give that head (heads split in chunks of ceil(heads / threads)).  So a head's bits
//     depend on the thread count, in torch and here alike.
// kernels.sdpa_decode_agrees compares it with torch's SDPA bit for bit at load; the engine uses it only where
// they agree (another torch, another BLAS, AVX2 dispatch: torch's own SDPA runs).
#pragma once

#if !defined(CPU_CAPABILITY_AVX512)
#error "sdpa_decode.h reproduces torch's AVX512 kernels: compile with -DCPU_CAPABILITY_AVX512 -DCPU_CAPABILITY=AVX512"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// the Fortran BLAS sgemm libtorch_cpu exports (MKL's in torch's x86 wheels): what cpublas::gemm calls for float
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace rtk_sdpa {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t KV_SPLIT = 512;     // cpu_flash_attention's key block for queries of fewer than 192 rows
constexpr int64_t ALIGN_FLOATS = 16;  // c10's CPU allocations start on 64-byte boundaries

// cpublas::gemm (float, column-major): its normalize_last_dims, then sgemm_
inline void gemm(bool trans_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float beta, float* c, int64_t ldc) {
  if (n == 1) ldc = m;
  if (trans_a) {
    if (m == 1) lda = k;
  } else if (k == 1) {
    lda = m;
  }
  if (n == 1) ldb = k;  // b is never transposed here
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(lda), ldb_ = static_cast<int>(ldb), ldc_ = static_cast<int>(ldc);
  const char ta = trans_a ? 't' : 'n', tb = 'n';
  const float alpha = 1.0f;
  sgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

// s[i] *= scale, and their max (16 lanes, then the tail)
inline float scale_and_max(float* s, int64_t n, float scale) {
  const int64_t vs = Vec::size(), body = n - n % vs;
  const Vec vscale(scale);
  Vec vmax(-std::numeric_limits<float>::infinity());
  float tail_max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < body; i += vs) {
    const Vec t = Vec::loadu(s + i) * vscale;
    vmax = at::vec::maximum(vmax, t);
    t.store(s + i);
  }
  for (int64_t i = body; i < n; ++i) {
    s[i] = s[i] * scale;
    tail_max = std::max(tail_max, s[i]);
  }
  return std::max(tail_max, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
}

// s[i] = exp(s[i] - mx) (exp_u20 in 16 lanes, the tail by C's double exp), and their sum in that order
inline float exp_and_sum(float* s, int64_t n, float mx) {
  const int64_t vs = Vec::size(), body = n - n % vs;
  const Vec vmx(mx);
  Vec vsum(0.0f);
  for (int64_t i = 0; i < body; i += vs) {
    const Vec t = (Vec::loadu(s + i) - vmx).exp_u20();
    vsum += t;
    t.store(s + i);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (int64_t i = body; i < n; ++i) {
    s[i] = static_cast<float>(std::exp(static_cast<double>(s[i] - mx)));
    sum += s[i];
  }
  return sum;
}

// One query head over L keys: q [D]; k, v [L] rows of stride ld; buf laid out as torch's per-thread buffer
// (scores of one key block, max, sum, output accumulator [D]); out [D].
inline void head(const float* q, const float* k, const float* v, int64_t ld, int64_t L, int64_t D, float scale,
                 float* buf, float* out) {
  const int64_t kvs = std::min(KV_SPLIT, L);
  float* qk = buf;
  float* dst = buf + kvs + 2;
  float run_max = -std::numeric_limits<float>::infinity(), run_sum = 0.0f;
  for (int64_t n = 0; n < L; n += KV_SPLIT) {
    const int64_t blk = std::min(KV_SPLIT, L - n);
    gemm(true, blk, 1, D, k + n * ld, ld, q, D, 0.0f, qk, blk);
    const float mx = std::max(run_max, scale_and_max(qk, blk, scale));
    const float sum = exp_and_sum(qk, blk, mx);
    const float rescale = std::exp(run_max - mx);
    run_sum = std::fma(rescale, run_sum, sum);
    run_max = mx;
    if (n > 0) at::vec::map<float>([rescale](Vec x) { return x * Vec(rescale); }, dst, dst, D);
    gemm(false, D, 1, blk, v + n * ld, ld, qk, blk, n == 0 ? 0.0f : 1.0f, dst, D);
  }
  const float reciprocal = 1 / run_sum;
  at::vec::map<float>([reciprocal](Vec x) { return x * Vec(reciprocal); }, out, dst, D);
}

// Element j of a K or V source as float32: a float32 one's as it is, a bf16 one's (uint16_t bits) widened exactly
inline float widen(const float* p, int64_t j) { return p[j]; }
inline float widen(const uint16_t* p, int64_t j) {
  const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Copies the rows ``slots[0 .. L)`` of a [slots, KVH, D] pool into dst [L, KVH, D] as float32: the gathered
// context torch's SDPA is given (KVPool.gather's numbers, the same layout)
template <class T>
inline void gather_rows(const T* pool, const int64_t* slots, int64_t L, int64_t row, float* dst) {
  for (int64_t j = 0; j < L; ++j) {
    const T* src = pool + slots[j] * row;
    float* d = dst + j * row;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(d, src, row * sizeof(float));
    } else {
      for (int64_t i = 0; i < row; ++i) d[i] = widen(src, i);
    }
  }
}

// q [m, H, D] float32 (D and H contiguous) -> [m, H * D] float32, row r = torch's SDPA of q[r] alone over its
// keys with the thread count of this call.  Without slots, k and v [n, KVH, D] are float32 rows gathered
// already, row r's keys at rows bounds[r, 0] .. bounds[r, 1]; with slots, k and v are the paged pool
// [slots, KVH, D] (float32 or bf16) and row r's keys lie at slots[bounds[r, 0] .. bounds[r, 1]]: each row's
// context is gathered into a buffer of the thread that attends it (no copy of every row's context at once).
// ``who`` names the op in messages.
inline at::Tensor decode(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& slots, const at::Tensor& bounds, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2), who,
              ": q must be [rows, heads, head_dim] float32 with heads and head_dim contiguous");
  const int64_t m = q.size(0), H = q.size(1), D = q.size(2);
  const auto dtype = k.scalar_type();
  const bool pool = slots.has_value();
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
                  v.scalar_type() == dtype && (dtype == at::kFloat || (pool && dtype == at::kBFloat16)) &&
                  k.size(2) == D,
              who, pool ? ": a K/V pool must be [slots, kv_heads, head_dim] float32 or bf16, contiguous, head_dim as q's"
                        : ": k and v must be [keys, kv_heads, head_dim] float32, contiguous, head_dim as q's");
  const int64_t KVH = k.size(1), ld = KVH * D;
  TORCH_CHECK(KVH > 0 && H % KVH == 0, who, ": heads must be a multiple of kv_heads");
  const at::Tensor b = bounds.contiguous();
  TORCH_CHECK(b.scalar_type() == at::kLong && b.dim() == 2 && b.size(0) == m && b.size(1) == 2, who,
              ": int64 bounds [rows, 2]");
  at::Tensor sl = pool ? slots->contiguous() : at::Tensor();
  TORCH_CHECK(!pool || (sl.scalar_type() == at::kLong && sl.dim() == 1), who, ": int64 slots [keys]");
  const int64_t keys = pool ? sl.numel() : k.size(0);
  const auto* bp = b.data_ptr<int64_t>();
  const int64_t* sp = pool ? sl.data_ptr<int64_t>() : nullptr;
  int64_t longest = 1, total = 0;
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(0 <= bp[2 * r] && bp[2 * r] < bp[2 * r + 1] && bp[2 * r + 1] <= keys, who,
                ": a row's key range is out of bounds");
    longest = std::max(longest, bp[2 * r + 1] - bp[2 * r]);
    total += bp[2 * r + 1] - bp[2 * r];
  }
  for (int64_t j = 0; pool && j < keys; ++j)
    TORCH_CHECK(sp[j] >= 0 && sp[j] < k.size(0), who, ": a context slot is out of range");
  at::Tensor out = at::empty({m, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t G = H / KVH, q_row = q.stride(0);
  // the OpenMP thread torch's parallel_for(0, H, 1) would run head h on: chunks of ceil(H / threads)
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), H), chunk = (H + threads - 1) / threads;
  const int64_t buf_floats = std::min(KV_SPLIT, longest) + 2 + D + ALIGN_FLOATS;
  const int64_t context_floats = pool ? longest * ld : 0;
  // threads only where there is enough to share: an OpenMP region costs more than a short context's heads
  // (SmolLM2's 9 heads of one row, Zen 4, 2 threads: level at ~60 keys, 25-30 % faster in two threads from 96
  // keys on).  A head's bits do not depend on which thread runs it here, only on the thread count above.
  const int64_t grain = total * H * D < (1 << 15) ? m * H : 1;
  at::parallel_for(0, m * H, grain, [&](int64_t z0, int64_t z1) {
    // torch's buffer (64-byte aligned, as c10 allocates), and this thread's copy of a row's K and V
    const int64_t context_at = (buf_floats + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    at::Tensor scratch = at::empty({context_at + 2 * context_floats}, at::kFloat);
    float* base = scratch.data_ptr<float>();
    float* kc = base + context_at;
    float* vc = kc + context_floats;
    int64_t copied = -1;  // the row whose context kc and vc hold
    for (int64_t z = z0; z < z1; ++z) {
      const int64_t r = z / H, h = z % H, L = bp[2 * r + 1] - bp[2 * r];
      const int64_t per_thread = std::min(KV_SPLIT, L) + 2 + D;  // torch's size_per_thread for this call
      float* buf = base + (h / chunk) * per_thread % ALIGN_FLOATS;
      const float* kr;
      const float* vr;
      if (pool) {
        if (copied != r) {
          if (dtype == at::kFloat) {
            gather_rows(k.data_ptr<float>(), sp + bp[2 * r], L, ld, kc);
            gather_rows(v.data_ptr<float>(), sp + bp[2 * r], L, ld, vc);
          } else {
            gather_rows(reinterpret_cast<const uint16_t*>(k.data_ptr()), sp + bp[2 * r], L, ld, kc);
            gather_rows(reinterpret_cast<const uint16_t*>(v.data_ptr()), sp + bp[2 * r], L, ld, vc);
          }
          copied = r;
        }
        kr = kc;
        vr = vc;
      } else {
        kr = k.data_ptr<float>() + bp[2 * r] * ld;
        vr = v.data_ptr<float>() + bp[2 * r] * ld;
      }
      head(qp + r * q_row + h * D, kr + h / G * D, vr + h / G * D, ld, L, D, s, buf, op + r * H * D + h * D);
    }
  });
  return out;
}

}  // namespace rtk_sdpa
