// When kernels/topk.cu splits a long row over independent CTAs, and the scratch that takes:
// shared by the kernel's launcher and the FFI handlers (which size the scratch result on every
// platform, CUDA built or not, so an exported program's shapes do not depend on the machine).
//
// A row of more than kChunkCols keys is cut into `chunks` chunks of ChunkCols columns (the last
// one shorter), one CTA each: no cluster barriers or distributed shared memory. Each chunk's top
// k, in column order, lands in the scratch as candidates (their values, then their columns); a
// second launch selects the row's top k among its chunks * k candidates (one CTA a row) and maps
// them back to columns. The top k of the union of each chunk's top k is the row's top k, and the
// candidates' order (chunk, then column) is column order, so ties keep lax.top_k's order.
//
// Not split: rows whose candidates would not fit one CTA (chunks * k > kMaxCandidates), and
// unsorted rows of 2 chunks (32769-65536 keys), where a cluster of 2 CTAs measured faster
// (H200, benchmarks/topk_shapes.cu `split`: 0.76-1.07x for the split). Sorted rows of 2 chunks
// get a scratch, but the launcher still takes the cluster where all the row's clusters run at
// once (JaxDgTopkSplits: it depends on the device's SM count, which the shape cannot know).
#pragma once

#include <cstdint>

namespace jax_dg_topk {

constexpr int64_t kChunkCols = 32768;       // one CTA of 512 threads x 64 keys
constexpr int64_t kMaxCandidates = 32768;   // the second launch's row: one CTA

// Chunks a row of `cols` keys is split into for top-k with at most `chunk_cols` keys a chunk,
// or 0 where the row is not split (it fits one chunk, or its candidates would not fit a CTA).
inline int64_t SplitChunks(int64_t cols, int64_t k, int64_t chunk_cols = kChunkCols) {
  if (cols <= chunk_cols || k <= 0 || chunk_cols <= 0) return 0;
  const int64_t chunks = (cols + chunk_cols - 1) / chunk_cols;
  return chunks * k <= kMaxCandidates ? chunks : 0;
}

// Columns a chunk (the last may have fewer): the row shared equally, rounded up to a multiple of
// 4 (16-byte loads stay aligned). No chunk is empty for cols > kChunkCols.
inline int64_t ChunkCols(int64_t cols, int64_t chunks) {
  return ((cols + chunks - 1) / chunks + 3) / 4 * 4;
}

// Chunks of a split the launcher may take for a sorted or unsorted top-k of rows of `cols` keys
// (0: never split; see above).
inline int64_t SplitChunksFor(int64_t cols, int64_t k, bool sorted) {
  const int64_t chunks = SplitChunks(cols, k);
  return chunks == 2 && !sorted ? 0 : chunks;
}

// Scratch bytes of a split top-k of [rows, cols] (0: not split): float32 values then int32
// columns, each [rows, chunks * k].
inline int64_t ScratchBytes(int64_t rows, int64_t cols, int64_t k, bool sorted) {
  return rows * SplitChunksFor(cols, k, sorted) * k * 8;
}

// The same for a split in chunks of at most chunk_cols keys (tuning: benchmarks/topk_shapes.cu).
inline int64_t ScratchBytesOfChunks(int64_t rows, int64_t cols, int64_t k, int64_t chunk_cols) {
  return rows * SplitChunks(cols, k, chunk_cols) * k * 8;
}

}  // namespace jax_dg_topk
