// jax_dg's own CUDA kernels: the paged MQA-logits call's index sanitising, before DeepGEMM's
// kernel reads the block table, the lengths and the schedule as addresses.
//
// SanitiseRows (a CTA a request) writes, for request b:
//   last = min(max(len_b, 0), limit, first_bad * block_size), first_bad the first entry among the
//          request's blocks (c < ceil(min(len_b, limit) / block_size)) outside [0, num_blocks)
//          (the context ends there; an entry past those blocks cannot shorten it);
//   ctx[b, :]   = the row lengths clipped to [0, last], the last row's = last;
//   table[b, :] = the entries with every out-of-range one replaced by block 0 and, with
//          zero_unused (block size 32: DeepGEMM reads entries in pairs), every entry from
//          ceil(last / block_size) on set to 0 too, over an even width.
// FixSchedule (one CTA, after it on the stream) bounds a caller's schedule [S + 1, 2] to the
// sanitised lengths, reading only `ctx`: jax_dg.reference.paged_mqa.bounded_schedule, which
// documents why (the identity on DeepGEMM's own schedule of those lengths).
// Any next_n (a request's lengths are written kRowThreads at a time). Only int32 loads and stores of
// the given arrays; no allocation, one or two launches on the given stream, the same on every
// call (capture-safe).

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

namespace {

constexpr int kRowThreads = 128;
constexpr int kScheduleThreads = 256;
constexpr int kSplit = 256;   // tokens per schedule split (DeepGEMM's SM90 paged kernel)

struct Rows {
  const int* lens;   // [B] (one_d: row j's length is lens[b] - next_n + 1 + j) or [B, next_n]
  const int* table;  // [B, width]
  int* ctx;          // [B, next_n]
  int* table_out;    // [B, out_width]
  int rows, next_n, width, out_width, block_size, limit;
  int64_t num_blocks;
  bool one_d, zero_unused;
};

__device__ __forceinline__ bool OutOfRange(int v, int64_t num_blocks) {
  return v < 0 || v >= num_blocks;
}

__device__ __forceinline__ int RowLength(const Rows& p, int b, int j) {
  if (!p.one_d) return p.lens[static_cast<int64_t>(b) * p.next_n + j];
  // int32 wrap-around, as XLA's subtraction in the reference
  return static_cast<int>(static_cast<uint32_t>(p.lens[b]) - static_cast<uint32_t>(p.next_n - 1 - j));
}

__device__ __forceinline__ int Blocks(int64_t tokens, int block_size) {
  return static_cast<int>((tokens + block_size - 1) / block_size);
}

__global__ void __launch_bounds__(kRowThreads) SanitiseRows(Rows p) {
  __shared__ int first_bad;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) first_bad = p.width;
  __syncthreads();
  const int given = min(max(RowLength(p, b, p.next_n - 1), 0), p.limit);
  const int used = Blocks(given, p.block_size);   // <= width: limit <= width * block_size
  const int* row = p.table + static_cast<int64_t>(b) * p.width;
  for (int c = threadIdx.x; c < used; c += kRowThreads) {
    if (OutOfRange(row[c], p.num_blocks)) {   // this thread's first: the block's is their min
      atomicMin(&first_bad, c);
      break;
    }
  }
  __syncthreads();
  const int64_t cut = static_cast<int64_t>(first_bad) * p.block_size;
  const int last = cut < given ? static_cast<int>(cut) : given;
  for (int j = threadIdx.x; j < p.next_n; j += kRowThreads) {
    const int len = j == p.next_n - 1 ? last : min(max(RowLength(p, b, j), 0), last);
    p.ctx[static_cast<int64_t>(b) * p.next_n + j] = len;
  }
  const int live = p.zero_unused ? Blocks(last, p.block_size) : p.out_width;
  int* out = p.table_out + static_cast<int64_t>(b) * p.out_width;
  for (int c = threadIdx.x; c < p.out_width; c += kRowThreads) {
    int v = c < p.width ? row[c] : 0;
    if (c >= live || OutOfRange(v, p.num_blocks)) v = 0;
    out[c] = v;
  }
}

// Keys q * k + y (k = splits a row can have + 1) order the tasks (row q, split y) row-major.
__global__ void __launch_bounds__(kScheduleThreads)
FixSchedule(const int* __restrict__ meta, int entries, const int* __restrict__ ctx, int next_n,
            int rows, int limit, int* __restrict__ out) {
  using Scan = cub::BlockScan<long long, kScheduleThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int first;
  __shared__ long long carry;
  auto last = [&](int b) { return ctx[static_cast<int64_t>(b) * next_n + next_n - 1]; };
  auto tasks = [&](int b) {   // >= 1 a row
    return max((static_cast<long long>(last(b)) + kSplit - 1) / kSplit, 1LL);
  };
  if (threadIdx.x == 0) {
    first = rows;
    carry = 0;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < rows; b += kScheduleThreads) {
    if (last(b) > 0) {
      atomicMin(&first, b);
      break;
    }
  }
  __syncthreads();
  const long long k = (limit + kSplit - 1) / kSplit + 1;
  const long long start = static_cast<long long>(first < rows ? first : rows - 1) * k;
  const long long cap = static_cast<long long>(rows - 1) * k + tasks(rows - 1) - 1;
  for (int base = 0; base < entries; base += kScheduleThreads) {
    const int s = base + threadIdx.x;
    long long key = 0;   // keys are >= 0: the identity of the running max
    if (s == entries - 1) {
      key = static_cast<long long>(rows) * k;   // the sentinel (B, 0)
    } else if (s == 0) {
      key = min(start, cap);
    } else if (s < entries) {
      const int q = min(max(meta[2 * s], 0), rows);
      const int y = max(meta[2 * s + 1], 0);
      const bool over = y >= (q < rows ? tasks(q) : 1);   // past its row: the next row's start
      key = min(over ? static_cast<long long>(min(q + 1, rows)) * k
                     : static_cast<long long>(q) * k + y, cap);
    }
    long long running;
    Scan(scan).InclusiveScan(key, running, [](long long a, long long b) { return a > b ? a : b; });
    running = running > carry ? running : carry;
    if (s < entries) {
      out[2 * s] = static_cast<int>(running / k);
      out[2 * s + 1] = static_cast<int>(running % k);
    }
    __syncthreads();   // every thread has read `carry` and `scan` is free again
    if (threadIdx.x == kScheduleThreads - 1) carry = running;
    __syncthreads();
  }
}

}  // namespace

// lens: int32 [rows] (one_d) or [rows, next_n]; table [rows, width] -> ctx [rows, next_n],
// table_out [rows, out_width] (out_width >= width); meta/meta_out [entries, 2] or null (no
// schedule to bound). The caller checks limit <= width * block_size and (rows + 1) * k < 2**31.
extern "C" int JaxDgPagedSanitise(const int* lens, int one_d, int next_n, const int* table, int rows,
                                  int width, int out_width, int64_t num_blocks, int block_size,
                                  int limit, int zero_unused, const int* meta, int entries,
                                  int* ctx, int* table_out, int* meta_out, cudaStream_t stream) {
  if (rows == 0) return 0;
  Rows p{lens, table, ctx, table_out, rows, next_n, width, out_width, block_size, limit, num_blocks,
         one_d != 0, zero_unused != 0};
  SanitiseRows<<<rows, kRowThreads, 0, stream>>>(p);
  if (meta != nullptr && entries > 0) {
    FixSchedule<<<1, kScheduleThreads, 0, stream>>>(meta, entries, ctx, next_n, rows, limit, meta_out);
  }
  return static_cast<int>(cudaGetLastError());
}
