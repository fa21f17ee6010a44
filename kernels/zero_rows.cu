// jax_dg's own CUDA kernels: zero the rows of an m-grouped GEMM's output that DeepGEMM leaves
// unspecified, writing only those rows (the grouped ops' `clean=True`, instead of a select
// that reads and writes the whole output).
//
// Masked layout, d [G, Mmax, row_bytes]: rows masked_m[g] <= r < Mmax of each group. DeepGEMM
// never writes the blocks past ceil(masked_m / BLOCK_M) (stale memory) and computes the rest of
// the last block from a's rows.
//
// Contiguous layout, d [M, row_bytes]: rows whose group id is < 0. With `skip_padding_blocks`,
// blocks of `block` rows whose first id is < 0 are left alone: DeepGEMM's SM90 FP8 kernel
// writes zeros there (established bitwise on the H200, tests/ops/test_grouped.py; its BF16
// kernel does not); padding rows inside a valid block are computed from a, so they are zero
// only where a's rows are.
//
// Rows are written with 16-byte stores: row_bytes % 16 == 0 and d 16-byte aligned (the ops'
// shape rules: N % 8 == 0, bf16). No allocation, one launch on the given stream.

#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 256;
constexpr int kCtas = 1056;   // enough stores in flight to fill the H200's write bandwidth

__global__ void __launch_bounds__(kThreads)
ZeroMaskedTail(uint4* __restrict__ d, int64_t row_vecs, int max_m, const int* __restrict__ masked_m) {
  const int g = blockIdx.y;
  const int first = min(max(masked_m[g], 0), max_m);
  const int64_t begin = static_cast<int64_t>(g) * max_m * row_vecs + first * row_vecs;
  const int64_t end = static_cast<int64_t>(g + 1) * max_m * row_vecs;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t i = begin + blockIdx.x * kThreads + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    d[i] = zero;
  }
}

// A warp per row: the warp reads its row's id (and, skipping, its block's first id) and, where
// the row is to be zeroed, writes it with coalesced 512-byte stores. Warps of rows to keep exit
// at once, so the rows to zero are written by as many warps at a time (a warp per 32 rows,
// writing its rows one after another, took 14.8 us for G8's ~380 padding rows of 8 KiB).
__global__ void __launch_bounds__(kThreads)
ZeroPaddingRows(uint4* __restrict__ d, int64_t row_vecs, int rows, int block,
                const int* __restrict__ layout, bool skip_padding_blocks) {
  const int r = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  if (r >= rows || layout[r] >= 0) return;
  if (skip_padding_blocks && layout[r - r % block] < 0) return;
  uint4* row = d + static_cast<int64_t>(r) * row_vecs;
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int64_t i = threadIdx.x % 32; i < row_vecs; i += 32) row[i] = z;
}

}  // namespace

extern "C" int JaxDgZeroMaskedTail(void* d, int64_t row_bytes, int groups, int max_m,
                                   const int* masked_m, cudaStream_t stream) {
  if (groups == 0 || max_m == 0 || row_bytes == 0) return 0;
  const int per_group = groups >= kCtas ? 1 : kCtas / groups;
  ZeroMaskedTail<<<dim3(per_group, groups), kThreads, 0, stream>>>(
      static_cast<uint4*>(d), row_bytes / 16, max_m, masked_m);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int JaxDgZeroPaddingRows(void* d, int64_t row_bytes, int rows, int block,
                                    const int* layout, int skip_padding_blocks, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return 0;
  constexpr int kRowsPerCta = kThreads / 32;   // a warp a row
  const int ctas = (rows + kRowsPerCta - 1) / kRowsPerCta;
  ZeroPaddingRows<<<ctas, kThreads, 0, stream>>>(static_cast<uint4*>(d), row_bytes / 16, rows,
                                                 block, layout, skip_padding_blocks != 0);
  return static_cast<int>(cudaGetLastError());
}
