// What one attention call looks like to the selection and exact code: where the rows of Q, K, V
// and Y are (strided, so the 4-D [B, H, S, D] form and GroupQueryAttention's [B, S, H*D] form with
// a max-length KV buffer share one path), how many keys each batch entry has, and the mask.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace ortsparse::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// Element strides (in floats) of a tensor of rows: row (b, head, position) starts at
// b * batch + head * head_stride + position * pos; the row's D (or Dv) floats are contiguous.
struct RowStrides {
  size_t batch = 0, head = 0, pos = 0;
  size_t at(size_t b, size_t h, size_t p) const { return b * batch + h * head + p * pos; }
};

// Contiguous [B, H, S, D]: the 4-D form.
inline RowStrides contiguous_bhsd(size_t h, size_t s, size_t d) { return RowStrides{h * s * d, s * d, d}; }

struct AttentionDims {
  size_t b = 0, h = 0, hkv = 0, sq = 0, skv = 0, d = 0, dv = 0;  // skv: the key axis' length (buffer)
};

// The mask broadcast to [B, H, Sq, Skv] by strides (0 on broadcast dims): element (b, h, i, j) is
// at stride[0]*b + stride[1]*h + stride[2]*i + stride[3]*j. `keep` (bool: true = attend) or `add`
// (added to the scaled scores) or neither.
struct MaskView {
  const uint8_t* keep = nullptr;
  const float* add = nullptr;
  size_t stride[4] = {0, 0, 0, 0};
};

struct AttentionCall {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  float* y = nullptr;
  AttentionDims dims;
  RowStrides q_rows, k_rows, v_rows, y_rows;
  // Per batch entry: keys valid in K/V (<= dims.skv) and the sequence position of query 0. Empty:
  // every entry has dims.skv keys and query i sits at skv - sq + i (a KV cache ending at the queries).
  std::vector<size_t> kv_len;
  std::vector<int64_t> q_pos0;
  MaskView mask;
  // Per query head [H]: the logit of an extra key with a zero V row in every softmax (an attention
  // sink, as GroupQueryAttention's head_sink); null: none, or 0 with smooth_softmax.
  const float* head_sink = nullptr;
  size_t keys(size_t b) const { return kv_len.empty() ? dims.skv : kv_len[b]; }
  int64_t position(size_t b, size_t i) const {
    return (q_pos0.empty() ? static_cast<int64_t>(keys(b)) - static_cast<int64_t>(dims.sq) : q_pos0[b]) +
           static_cast<int64_t>(i);
  }
};

}  // namespace ortsparse::attention
