// Rows [0, rows) in blocks of at most `max_rows`, split as evenly as that allows (32 rows, 6 at most: 6,6,5,5,5,5,
// not 6,6,6,6,6,2): a block of few rows pays a whole pass over a chunk of the panel for little work.
#pragma once
#include <cstdint>

namespace inflight {

struct RowSplit {
  int64_t blocks, base, extra;
  RowSplit(int64_t rows, int max_rows)
      : blocks((rows + max_rows - 1) / max_rows), base(blocks ? rows / blocks : 0), extra(blocks ? rows % blocks : 0) {}
  int rows(int64_t b) const { return (int)(base + (b < extra ? 1 : 0)); }
};

}  // namespace inflight
