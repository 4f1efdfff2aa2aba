// Paged-attention primitives for the CPU, read straight from the block-structured KV cache
// (no gathered copy of a sequence's keys and values), registered as torch operators in the
// namespace `tokenloom_cpu`. The torch reference they are tested against is
// tokenloom/kernels/paged_attention.py; tokenloom/kernels/cpu_native.py builds and loads them.
//
// Cache layout (one tensor per layer): [2, num_blocks, block_size, num_kv_heads, head_size],
// contiguous; token p of a sequence lives in slot block_table[p / block_size] * block_size +
// p % block_size. Activations may be float32, bfloat16 or float16; arithmetic is float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 widens by a shift: written out so the compiler vectorises it
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename scalar_t>
inline void store_row(const float* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

// kHead > 0: the head size known at compile time (the loops unroll into registers); 0: any
template <int kHead>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t size = kHead > 0 ? kHead : n;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < size; ++i) acc += a[i] * b[i];
  return acc;
}

template <int kHead>
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const int64_t size = kHead > 0 ? kHead : n;
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) y[i] += alpha * x[i];
}

// Calls visit(t, slot) for the positions first .. seq_len - 1 (t counting from 0), walking the
// block table block by block rather than dividing per position.
template <typename Visit>
inline void for_each_slot(const int64_t* table, int64_t block_size, int64_t first, int64_t seq_len, Visit visit) {
  int64_t t = 0;
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t offset = pos % block_size;
    const int64_t base = table[pos / block_size] * block_size;
    const int64_t run = std::min(block_size - offset, seq_len - pos);
    for (int64_t j = 0; j < run; ++j) visit(t + j, base + offset + j);
    t += run;
    pos += run;
  }
}

// One query token per sequence. A work item is a sequence and a range of its KV heads (all of
// them once there are enough sequences to share out): each cached token's row of those heads
// is read once, sequentially within a block, for all their query heads. Scores live in a
// per-thread scratch buffer, [query head][key].
template <typename scalar_t, int kHead>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           int64_t sliding_window, double soft_cap) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_q_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group_size = num_q_heads / num_kv_heads;
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t out_seq_stride = out.stride(0), out_head_stride = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t slot_stride = num_kv_heads * head_size;
  const int64_t cache_half = kv_cache.size(1) * block_size * slot_stride;
  // few sequences: split each one's heads over the threads too
  const int64_t heads_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_cache = k_cache + cache_half;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);

  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = heads_per_item * group_size;  // query heads of one item
    std::vector<float> q_rows(rows * head_size), kv_row(heads_per_item * head_size), acc(rows * head_size), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t first_kv_head = (item % items_per_seq) * heads_per_item;
      const int64_t seq_len = lens[seq];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t num_keys = seq_len - first;
      if (num_keys <= 0) continue;
      const int64_t* table = tables + seq * table_stride;
      const int64_t first_q_head = first_kv_head * group_size;
      for (int64_t r = 0; r < rows; ++r) {
        load_row(q_ptr + seq * q_seq_stride + (first_q_head + r) * q_head_stride, q_rows.data() + r * head_size,
                 head_size);
      }
      scores.resize(rows * num_keys);
      float* score_rows = scores.data();
      const float* q_data = q_rows.data();
      float* row_data = kv_row.data();
      const int64_t row_offset = first_kv_head * head_size, row_len = heads_per_item * head_size;
      // a token's keys of these heads are adjacent: widened once for all their query heads
      for_each_slot(table, block_size, first, seq_len, [&](int64_t t, int64_t slot) {
        load_row(k_cache + slot * slot_stride + row_offset, row_data, row_len);
        for (int64_t r = 0; r < rows; ++r) {
          score_rows[r * num_keys + t] =
              dot<kHead>(q_data + r * head_size, row_data + (r / group_size) * head_size, head_size) * fscale;
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        float* s = score_rows + r * num_keys;
        if (cap > 0.f) {
          for (int64_t t = 0; t < num_keys; ++t) s[t] = std::tanh(s[t] / cap) * cap;
        }
        // the first score seeds the maximum: every value stays finite (the build is -ffast-math)
        float max_score = s[0];
        for (int64_t t = 1; t < num_keys; ++t) max_score = std::max(max_score, s[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < num_keys; ++t) {
          s[t] = std::exp(s[t] - max_score);
          total += s[t];
        }
        const float inv_total = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < num_keys; ++t) s[t] *= inv_total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float* acc_data = acc.data();
      for_each_slot(table, block_size, first, seq_len, [&](int64_t t, int64_t slot) {
        load_row(v_cache + slot * slot_stride + row_offset, row_data, row_len);
        for (int64_t r = 0; r < rows; ++r) {
          axpy<kHead>(score_rows[r * num_keys + t], row_data + (r / group_size) * head_size, acc_data + r * head_size,
                      head_size);
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        store_row(acc_data + r * head_size, out_ptr + seq * out_seq_stride + (first_q_head + r) * out_head_stride,
                  head_size);
      }
    }
  });
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be one contiguous [2, num_blocks, block_size, num_kv_heads, head_size] tensor");
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, double soft_cap) {
  check_cache(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_q_heads, head_size] with "
              "contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == query.scalar_type(),
              "out must match query");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and kv_cache must share a dtype");
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && query.size(1) % kv_cache.size(3) == 0,
              "query heads must group evenly over the cache's KV heads of the same size");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "block_tables must be int64 [num_seqs, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be a contiguous int64 [num_seqs] tensor");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    switch (query.size(2)) {
      case 64:
        return decode_attention_impl<scalar_t, 64>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                   sliding_window, soft_cap);
      case 128:
        return decode_attention_impl<scalar_t, 128>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                    sliding_window, soft_cap);
      case 256:
        return decode_attention_impl<scalar_t, 256>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                    sliding_window, soft_cap);
      default:
        return decode_attention_impl<scalar_t, 0>(out, query, kv_cache, block_tables, seq_lens, scale,
                                                  sliding_window, soft_cap);
    }
  });
}

// Stores each token's key and value rows at its flat slot (block_id * block_size + offset).
template <typename scalar_t>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t slot_stride = num_kv_heads * head_size;
  const int64_t cache_half = kv_cache.size(1) * kv_cache.size(2) * slot_stride;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
  scalar_t* v_cache = k_cache + cache_half;
  const scalar_t* k_ptr = key.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the KV cache's ", num_slots, " slots");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(k_cache + slot * slot_stride + h * head_size, k_ptr + t * key.stride(0) + h * key.stride(1),
                  head_size * sizeof(scalar_t));
      std::memcpy(v_cache + slot * slot_stride + h * head_size, v_ptr + t * value.stride(0) + h * value.stride(1),
                  head_size * sizeof(scalar_t));
    }
  }
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [num_tokens, num_kv_heads, head_size] with contiguous heads");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "key heads must match the cache's");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be a contiguous int64 [num_tokens] tensor");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv_cache", [&] {
    write_kv_impl<scalar_t>(key, value, kv_cache, slot_mapping);
  });
}

}  // namespace

TORCH_LIBRARY(tokenloom_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float soft_cap) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
