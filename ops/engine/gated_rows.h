// What an input gate hands the weight backend: per token, the K-rows (inputs) that take part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/scratch.h"

namespace ortsparse::engine {

// The K-dim partition shared by every gate, so masks of different gates line up.
struct BlockPartition {
  size_t k = 0;
  size_t block = 1;
  size_t num_blocks = 0;

  BlockPartition() = default;
  BlockPartition(size_t k_, size_t block_) : k(k_), block(block_), num_blocks((k_ + block_ - 1) / block_) {}
  size_t begin(size_t b) const { return b * block; }
  size_t end(size_t b) const { return (b + 1) * block < k ? (b + 1) * block : k; }
};

// Rows of token m: rows[offset[m] .. offset[m+1]) (ascending K indices), or every row when
// dense[m]. The product of token m is multiplied by scale[m] (renorm; 1 otherwise).
struct GatedRows {
  std::vector<int32_t> rows;
  std::vector<size_t> offset{0};
  std::vector<uint8_t> dense;
  std::vector<float> scale;

  void clear() {
    rows.clear();
    offset.assign(1, 0);
    dense.clear();
    scale.clear();
  }
  size_t tokens() const { return dense.size(); }
  void add_dense_token() {
    dense.push_back(1);
    scale.push_back(1.0f);
    offset.push_back(rows.size());
  }
  // Appends the rows of the kept blocks (ascending block indices).
  void add_token_blocks(const BlockPartition& part, const int32_t* kept_blocks, size_t count, float token_scale) {
    if (part.block == 1) {
      rows.insert(rows.end(), kept_blocks, kept_blocks + count);
    } else {
      for (size_t i = 0; i < count; ++i) {
        const size_t b = static_cast<size_t>(kept_blocks[i]);
        for (size_t r = part.begin(b); r < part.end(b); ++r) rows.push_back(static_cast<int32_t>(r));
      }
    }
    dense.push_back(0);
    scale.push_back(token_scale);
    offset.push_back(rows.size());
  }
  size_t row_count(size_t m, size_t k) const { return dense[m] ? k : offset[m + 1] - offset[m]; }
  // After a large call: drops buffers grown past kKeepScratchBytes (common/scratch.h).
  void release_if_large() { ortsparse::release_if_large(rows, offset, dense, scale); }
};

}  // namespace ortsparse::engine
