// jax_dg's own CUDA kernel: exact per-row top-k of float32 logits (the indexer's selection).
//
// A row is split over a cluster of C CTAs (C = 1, 2, 4 or 8; Hopper thread-block clusters):
// each thread holds kItems keys of the row in registers (groups of 4 consecutive columns,
// striped over the CTA so that every load is coalesced), read from global memory once. A
// radix select over the order-preserving uint32 key of each float then finds the k-th
// largest key in at most three passes over those registers (digits of 11, 11 and 10 bits, most
// significant first; each pass counts only the keys that share the digits found so far): each
// CTA counts its keys into a shared-memory histogram, the cluster's histograms are summed
// through distributed shared memory, and every CTA takes the same bin. Most rows stop after
// two passes, when the bin that holds the k-th key is taken whole.
//
// Then every selected key gets its slot from one block-wide scan, in column order. When the last
// pass took its bin whole (no tie to cut: most rows) the selection is one compare per key,
// `key >= prefix`; otherwise the scan counts (keys above the threshold, keys equal to it) and
// takes the keys above it and the first `need` equal to it. The cluster's first CTA gathers the
// row's columns in shared memory and writes them coalesced: unsorted, in column order; sorted,
// in value-descending order, equal values in column order (lax.top_k's), by a bucket sort (k <=
// 2048, rows <= 32768 keys, no bucket over 32 keys) or a stable LSD radix sort of (key - prefix,
// column) on the bits the selected keys can differ in (up to 8-bit digits ranked with match.any).
// No atomics decide a slot: the result is the same on every run.
//
// Loads are asynchronous copies (cp.async) through shared memory. A grid can be persistent
// (cluster c takes rows c, c + clusters, ..., starting the next row's copies before it selects
// the current one) or have a cluster a row; JaxDgTopkRows picks per shape from measurements.
// The cluster size is a template parameter (no cluster code in single-CTA rows), and the first
// pass counts every key without a branch (a non-candidate's key 0 falls in bin 0, which no
// candidate reaches). Measured on the H200 (benchmarks/topk_shapes.cu; RESULTS.md has the
// tables): from 16384 keys, 64 keys a thread halve the CTAs a row needs (1.8x at [4096, 32768],
// 2.6x at [64, 65536]).
//
// Rows of more than 32768 keys are split over independent CTAs where the caller gives a scratch
// (kernels/topk_split.h: each chunk's top k as candidates, then the row's top k among them; two
// launches of this kernel, its kChunks and kCandidates modes), except rows of 2 CTAs unsorted, or
// sorted with all their clusters running at once, where a cluster measured faster
// (JaxDgTopkSplits). At [256, 131072] the split is 1.06-1.45x the cluster of 4 (H200, session 13).
//
// Candidates of row r: columns c with lo[r] <= c < hi[r] (all when lo/hi are null), c < cols,
// and logits > -inf (NaN is not a candidate). Slots past the number of candidates get -1.
// Rows longer than a cluster holds (8 * 512 * 64 = 262144 keys) and not split (their candidates
// would not fit a CTA) go to kernels/topk_long.cu.

#include <cooperative_groups.h>
#include <cub/block/block_radix_rank.cuh>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

#include "topk_split.h"

namespace cg = cooperative_groups;

int JaxDgTopkLongRows(const float* logits, int64_t stride, const int* lo, const int* hi, int rows,
                      int cols, int k, int sorted, int* out, cudaStream_t stream);

namespace {

// Per-phase cycle counts (benchmarks/topk_shapes.cu's `phases` mode): built with -DTOPK_PHASES,
// the first thread of each cluster adds the cycles of each phase of each row it takes.
#ifdef TOPK_PHASES
__device__ unsigned long long g_topk_phases[16];   // [7]: rows; [8, 14): the bucket sort's steps
// Adds the cycles since `mark` to counter i and restarts `mark` (one thread calls it).
__device__ __forceinline__ void PhaseTick(int i, long long& mark) {
  const long long t = clock64();
  atomicAdd(&g_topk_phases[i], static_cast<unsigned long long>(t - mark));
  mark = t;
}
#define TOPK_MARK(i)                                        \
  do {                                                      \
    if (threadIdx.x == 0 && rank == 0) PhaseTick(i, mark_); \
  } while (0)
// The bucket sort's steps (it runs on rank 0 only).
#define TOPK_SUB(i)                           \
  do {                                        \
    if (threadIdx.x == 0) PhaseTick(i, sub_); \
  } while (0)
#else
#define TOPK_MARK(i) \
  do {               \
  } while (0)
#define TOPK_SUB(i) \
  do {              \
  } while (0)
#endif

constexpr int kThreads = 512;
constexpr int kBins = 2048;                 // 11-bit digits
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kMaxCluster = 8;              // portable cluster size
constexpr int kMaxK = 4096;

using Scan = cub::BlockScan<uint32_t, kThreads>;

// The sort: LSD radix passes of up to 8-bit digits, each ranked with match.any (CUB's
// BlockRadixRankMatch; stable for keys held warp-striped). Measured on the H200 against CUB's
// BlockRadixSort (5-bit digits): 1.02-1.33x faster sorted top-k (topk_shapes.cu, k 512-4096).
constexpr int kRankBits = 8;

template <int kSortItems>
struct SortOf {
  using Rank = cub::BlockRadixRankMatch<kThreads, kRankBits, true>;   // descending, stable
  using TempStorage = typename Rank::TempStorage;
};
template <>
struct SortOf<0> {
  struct TempStorage {};
};

// A radix digit of the keys being sorted (what BlockRadixRankMatch asks of an extractor).
struct Digits {
  uint32_t shift, mask;
  __device__ __forceinline__ uint32_t Digit(uint32_t key) const { return (key >> shift) & mask; }
};

template <int kItems, int kSortItems>
struct SelectShared {
  // The stage holds the next row's logits (cp.async) while a persistent CTA selects and sorts
  // this one, so it shares no memory with the sort.
  float4 stage[kThreads * kItems / 4];   // a warp's coalesced loads, handed out per lane
  typename SortOf<kSortItems>::TempStorage sort;
  alignas(16) uint32_t hist[2][kBins];   // two, alternating by pass: peers may still read the last one
                                         // (16-byte aligned: a thread reads its 4 bins at once)
  typename Scan::TempStorage scan;
  uint32_t cta_total;        // packed (above | equal << 16) of this CTA, read by later ranks
  int bin, above, count;     // FindBin's result, written by one thread
  int top;                   // the first pass's highest counted bin
};

template <int kItems, int kSortItems>
struct Shared : SelectShared<kItems, kSortItems> {
  using Rank = typename SortOf<kSortItems>::Rank;
  uint32_t key[kThreads * kSortItems];   // the selected (key, column) pairs, in column order,
  int col[kThreads * kSortItems];        // then in the sort's order after each pass
};
template <int kItems>
struct Shared<kItems, 0> : SelectShared<kItems, 0> {
  int col[kMaxK];   // the selected columns, in column order: written out coalesced
};

// Threads of the CTA, or of the whole cluster, wait for each other (with memory ordering).
template <int kCluster>
__device__ __forceinline__ void Sync() {
  if constexpr (kCluster > 1) {
    cg::this_cluster().sync();
  } else {
    __syncthreads();
  }
}

template <int kCluster, typename T>
__device__ __forceinline__ T* InRank(T* p, int rank) {
  if constexpr (kCluster > 1) {
    return cg::this_cluster().map_shared_rank(p, rank);
  } else {
    return p;
  }
}

// A thread's kBinsPerThread (4) bins, highest first: bins kBins - 1 - 4 tid - j, read as one
// 16-byte load (4 scalar loads at a lane stride of 4 words conflict 4-way in shared memory).
static_assert(kBinsPerThread == 4, "a thread's bins are one uint4");
__device__ __forceinline__ uint4& BinsOf(uint32_t* hist, int tid) {
  return *reinterpret_cast<uint4*>(hist + kBins - kBinsPerThread * (tid + 1));
}
__device__ __forceinline__ void Unpack(const uint4& v, uint32_t (&c)[kBinsPerThread]) {
  c[0] = v.w;
  c[1] = v.z;
  c[2] = v.y;
  c[3] = v.x;
}

// Zeroes a CTA's histogram before a pass counts into it (a barrier after).
__device__ __forceinline__ void ZeroBins(uint32_t* hist) {
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) hist[threadIdx.x + j * kThreads] = 0;
  __syncthreads();
}

struct Found {
  uint32_t total;   // candidates counted
  int bin, above, count;   // the bin of the need-th largest, the count above it and in it
  int top;                 // the highest bin counted (first pass, total > 0)
};

// The bin of the need-th largest counted key (need <= total), from every CTA's histogram
// (summed over the cluster, read through distributed shared memory). Every thread (and every
// CTA of the cluster) returns the same.
// first: the first pass, whose bin 0 holds the non-candidates (key 0) and is not counted.
template <int kCluster, typename S>
__device__ __forceinline__ Found FindBin(S& sh, uint32_t* hist, int need, int rank, bool first) {
  const int tid = threadIdx.x;
  Sync<kCluster>();   // every CTA's histogram is complete
  uint32_t c[kBinsPerThread], sum = 0;   // this thread's bins, highest first
  Unpack(BinsOf(hist, tid), c);
  // One CTA: only this thread reads these bins, so it zeroes them for the next pass (the barrier
  // below orders that before the next pass counts). A cluster's peers read them remotely: the
  // pass zeroes its histogram first.
  if constexpr (kCluster == 1) BinsOf(hist, tid) = make_uint4(0, 0, 0, 0);
  if constexpr (kCluster > 1) {
#pragma unroll 1
    for (int r = 1; r < kCluster; ++r) {
      uint32_t d[kBinsPerThread];
      Unpack(BinsOf(cg::this_cluster().map_shared_rank(hist, (rank + r) % kCluster), tid), d);
#pragma unroll
      for (int j = 0; j < kBinsPerThread; ++j) c[j] += d[j];
    }
  }
  if (first && tid == kThreads - 1) c[kBinsPerThread - 1] = 0;   // bin 0
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) sum += c[j];
  uint32_t before, total;
  Scan(sh.scan).ExclusiveSum(sum, before, total);
  if (first && before == 0 && sum > 0) {   // one thread: the highest counted bin
#pragma unroll
    for (int j = kBinsPerThread - 1; j >= 0; --j) {
      if (c[j] > 0) sh.top = kBins - 1 - (tid * kBinsPerThread + j);
    }
  }
  const uint32_t want = static_cast<uint32_t>(need);
  if (before < want && want <= before + sum) {   // one thread: the bin of the need-th key
    uint32_t acc = before;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (acc + c[j] >= want) {
        sh.bin = kBins - 1 - (tid * kBinsPerThread + j);
        sh.above = static_cast<int>(acc);
        sh.count = static_cast<int>(c[j]);
        break;
      }
      acc += c[j];
    }
  }
  __syncthreads();
  // No barrier after the read: the next writes of sh.bin, sh.top and sh.scan come after the next
  // call's first barrier (or, for the slots' scan, after this one's).
  return Found{total, sh.bin, sh.above, sh.count, sh.top};
}

// A float's order-preserving uint32 key (sign set: bits | 1 << 31; clear: ~bits), or 0 for
// -inf and NaN (never candidates): every candidate's key lies in [key(-FLT_MAX), key(+inf)] =
// [0x00800000, 0xff800000].
__device__ __forceinline__ uint32_t CandidateKey(float v) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t key = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
  return key - 0x00800000u <= 0xff800000u - 0x00800000u ? key : 0u;
}

// Asynchronous copies global -> shared (sm80+): the next row loads while this one is selected.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src) {   // dst: a shared address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  CopyAsync16(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src);
}
__device__ __forceinline__ void CopyAsync4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src) : "memory");
}
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// A candidate range [begin, end) of a grid row's columns: begin <= end <= its length (no load
// past the row).
struct Range {
  int begin, end;
};

// What a launch's grid rows are (a template parameter: the plain rows' kernels carry no split
// code). A long row split over independent CTAs (kernels/topk_split.h) takes two launches: the
// first takes each chunk of a row as a grid row and writes the chunk's top k (column order) as
// candidates, their values and columns; the second selects each row's top k among its candidates
// and maps them back to columns.
enum Mode { kRows = 0, kChunks = 1, kCandidates = 2 };
struct Split {
  int chunks = 0;                  // kChunks: grid rows a logits row
  int chunk_cols = 0;              // kChunks: columns a chunk (jax_dg_topk::ChunkCols: a multiple of 4)
  float* vals = nullptr;           // kChunks: the chunk's selected values, -inf past them
  const int* cand_cols = nullptr;  // kCandidates: the candidates' columns, laid out as the logits
};

// Grid row `row`: where its logits start and its candidate range.
struct Part {
  const float* x;
  Range r;
};
template <int kMode>
__device__ __forceinline__ Part Locate(const float* logits, int64_t stride, const int* lo, const int* hi,
                                       int row, int cols, const Split& s) {
  if constexpr (kMode == kChunks) {
    const int r = row / s.chunks, col0 = (row - r * s.chunks) * s.chunk_cols;   // (as WriteRow)
    const int n = max(min(cols - col0, s.chunk_cols), 0);
    // lo/hi clamped to the chunk before the shift (no overflow at INT_MIN / INT_MAX)
    const int begin = lo ? min(max(lo[r], col0), col0 + n) - col0 : 0;
    const int end = hi ? min(max(hi[r], col0), col0 + n) - col0 : n;
    return {logits + static_cast<int64_t>(r) * stride + col0, {begin, max(end, begin)}};
  } else {
    const int begin = lo ? min(max(lo[row], 0), cols) : 0;
    return {logits + static_cast<int64_t>(row) * stride, {begin, max(hi ? min(hi[row], cols) : cols, begin)}};
  }
}

// Writes slots [0, k) of grid row `row`'s output from the selected columns (sh_col[0, selected),
// in output order), -1 past them; a chunk's launch adds their values (read again from the row,
// which L2 still holds: measured faster than keeping their keys in shared memory), a candidates'
// launch maps candidates to columns.
template <int kMode>
__device__ __forceinline__ void WriteRow(const int* sh_col, int selected, int k, int row,
                                         const float* logits, int64_t stride, const Split& s, int* out) {
  int* o = out + static_cast<int64_t>(row) * k;
  if constexpr (kMode == kRows) {
    for (int t = threadIdx.x; t < k; t += kThreads) o[t] = t < selected ? sh_col[t] : -1;
  } else {
    // each thread's slots 4 at a time, read together and then written (one latency for the
    // gathers)
    constexpr int kBatch = 4;
    const float* x = nullptr;   // kChunks: the chunk's first logit
    int col0 = 0;
    if constexpr (kMode == kChunks) {   // (as Locate)
      const int r = row / s.chunks;
      col0 = (row - r * s.chunks) * s.chunk_cols;
      x = logits + static_cast<int64_t>(r) * stride + col0;
    }
#pragma unroll 1
    for (int t0 = threadIdx.x; t0 < k; t0 += kBatch * kThreads) {
      int c[kBatch];
      float v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = t0 + i * kThreads;
        c[i] = t < selected ? sh_col[t] : -1;
        v[i] = -INFINITY;
        if (c[i] >= 0) {
          if constexpr (kMode == kChunks) {
            v[i] = x[c[i]];
            c[i] += col0;
          } else {
            c[i] = s.cand_cols[static_cast<int64_t>(row) * stride + c[i]];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = t0 + i * kThreads;
        if (t < k) {
          o[t] = c[i];
          if constexpr (kMode == kChunks) s.vals[static_cast<int64_t>(row) * k + t] = v[i];
        }
      }
    }
  }
}

// Starts loading this thread's share of row `row` into its warp's part of the stage: a warp loads
// its 32 * kItems columns coalesced (lane l: float4 number v * 32 + l; float4 number q is stored
// at q ^ ((q >> 3) & 7): no bank conflict on the way in or out). Only columns in [begin, end)
// are loaded; the others keep what they held, and the key pass never takes them as candidates.
template <int kItems>
__device__ __forceinline__ void StartLoad(float4* stage, const float* x, Range r, int seg, int lane, bool vec) {
  // The warp's columns all inside (most warps): no per-chunk bound checks (with them the load was
  // 16 % of the kernel's instructions at [2048, 8192], session 10's profile).
  if (vec && seg >= r.begin && seg + 32 * kItems <= r.end) {
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
#pragma unroll
    for (int v = 0; v < kItems / 4; ++v) {
      const int q = v * 32 + lane;
      CopyAsync16(base + 16 * (q ^ ((q >> 3) & 7)), x + seg + 4 * q);
    }
    return;
  }
#pragma unroll
  for (int v = 0; v < kItems / 4; ++v) {
    const int q = v * 32 + lane;
    const int c = seg + 4 * q;
    float4* dst = stage + (q ^ ((q >> 3) & 7));
    if (c < r.end && c + 4 > r.begin) {
      if (vec) {   // c + 3 < stride: c (in a chunk, col0 + c) < cols <= stride, both multiples of 4
        CopyAsync16(dst, x + c);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (c + e >= r.begin && c + e < r.end) CopyAsync4(reinterpret_cast<float*>(dst) + e, x + c + e);
        }
      }
    }
  }
}

// The sorts of a row's selected (key, column) pairs, sh.key / sh.col[0, n) in column order, into
// output order (value descending, then column ascending: lax.top_k's), by rank 0's threads.
// Every key lies in [prefix, prefix + 2^end_bit). The columns end in sh.col[0, n).

// First try: buckets of the top kBucketBits bits of key - prefix (a histogram, a scan of it and a
// scatter), then each key's place in its bucket counted against the bucket's other keys. On random
// logits a bucket holds a few keys, and this is one pass where the radix sort takes three or four.
// Where a bucket holds more than kMaxBucket (ties, narrow values) it returns false having written
// nothing but the histograms, and the radix sort takes the row. The atomics give each key a
// position in its bucket that may vary from run to run; the final place is counted, so does not.
constexpr int kBucketBits = 11;   // 2048 buckets: the selection's histograms, reused
constexpr uint32_t kMaxBucket = 32;
static_assert(1 << kBucketBits == kBins, "a bucket is a histogram bin");

// zeroed: hist[0] is all zero already (one CTA: the selection leaves it so), and needs no zeroing
// pass and barrier.
template <int kSortItems, typename S>
__device__ __forceinline__ bool BucketSort(S& sh, int n, uint32_t prefix, int end_bit, bool zeroed) {
  const int tid = threadIdx.x;
  const int shift = max(end_bit - kBucketBits, 0);
  uint32_t* count = sh.hist[0];   // the selection is done with both (its last reader has synced)
  uint32_t* start = sh.hist[1];
#ifdef TOPK_PHASES
  long long sub_ = clock64();
#endif
  if (!zeroed) ZeroBins(count);
  // The pairs are read once, here: the barriers below order every read before any move.
  uint32_t pos[kSortItems], key[kSortItems];
  int col[kSortItems];
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int t = i * kThreads + tid;
    if (t < n) {
      key[i] = sh.key[t];
      col[i] = sh.col[t];
      pos[i] = atomicAdd(&count[(key[i] - prefix) >> shift], 1u);
    }
  }
  __syncthreads();
  TOPK_SUB(8);
  // bucket starts, highest bucket first; and whether one is too full
  uint32_t c[kBinsPerThread], sum = 0, most = 0;
  Unpack(BinsOf(count, tid), c);
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    sum += c[j];
    most = max(most, c[j]);
  }
  uint32_t before, total;
  Scan(sh.scan).ExclusiveSum(sum, before, total);
  uint32_t first[kBinsPerThread];   // this thread's buckets' starts, highest bucket first
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    first[j] = before;
    before += c[j];
  }
  BinsOf(start, tid) = make_uint4(first[3], first[2], first[1], first[0]);
  if (__syncthreads_or(most > kMaxBucket)) return false;
  TOPK_SUB(9);
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    if (i * kThreads + tid < n) pos[i] += start[(key[i] - prefix) >> shift];   // its place in its bucket's range
  }
  TOPK_SUB(10);
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    if (i * kThreads + tid < n) {
      sh.key[pos[i]] = key[i];
      sh.col[pos[i]] = col[i];
    }
  }
  __syncthreads();
  TOPK_SUB(11);
  // pos becomes the pair's final place: the bucket's pairs before it, counted for all items at
  // once, two of each bucket a step (their loads in flight together; a bucket holds a few pairs).
  int s[kSortItems], len[kSortItems], longest = 0;
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    len[i] = 0;
    s[i] = 0;
    if (i * kThreads + tid < n) {
      const uint32_t b = (key[i] - prefix) >> shift;
      s[i] = static_cast<int>(start[b]);
      len[i] = static_cast<int>(count[b]);
      longest = max(longest, len[i]);
    }
    pos[i] = static_cast<uint32_t>(s[i]);
  }
#pragma unroll 1
  for (int q = 0; q < longest; q += 2) {
#pragma unroll
    for (int i = 0; i < kSortItems; ++i) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (q + u < len[i]) {
          const uint32_t kq = sh.key[s[i] + q + u];
          const int cq = sh.col[s[i] + q + u];
          pos[i] += kq > key[i] || (kq == key[i] && cq < col[i]);
        }
      }
    }
  }
  __syncthreads();
  TOPK_SUB(12);
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    if (i * kThreads + tid < n) sh.col[pos[i]] = col[i];
  }
  __syncthreads();
  TOPK_SUB(13);
  return true;
}

// The general sort: a stable LSD radix sort of key - prefix over [0, end_bit) in digits of equal
// width <= kRankBits, each pass ranking the keys held warp-striped (the order match.any ranking
// keeps) and scattering them to their ranks in shared memory. Slots [n, kThreads * kSortItems)
// hold (prefix, -1), which sort after every selected key.
template <int kSortItems, typename S>
__device__ __forceinline__ void RadixSort(S& sh, uint32_t prefix, int end_bit) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t keys[kSortItems];
  int cols[kSortItems];
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int t = (warp * kSortItems + i) * 32 + lane;
    keys[i] = sh.key[t] - prefix;
    cols[i] = sh.col[t];
  }
  const int passes = (end_bit + kRankBits - 1) / kRankBits;
  const int width = (end_bit + passes - 1) / passes;
#pragma unroll 1
  for (int p = 0; p < passes; ++p) {
    int ranks[kSortItems];
    // (RankKeys starts with a barrier: every thread has read sh.key / sh.col by then)
    typename S::Rank(sh.sort).RankKeys(keys, ranks, Digits{static_cast<uint32_t>(p * width), (1u << width) - 1});
    const bool last = p + 1 == passes;
#pragma unroll
    for (int i = 0; i < kSortItems; ++i) {
      if (!last) sh.key[ranks[i]] = keys[i];
      sh.col[ranks[i]] = cols[i];
    }
    __syncthreads();
    if (!last) {
#pragma unroll
      for (int i = 0; i < kSortItems; ++i) {
        const int t = (warp * kSortItems + i) * 32 + lane;
        keys[i] = sh.key[t];
        cols[i] = sh.col[t];
      }
    }
  }
}

// kItems keys per thread (a multiple of 4); kSortItems: 0 unsorted, else the sort's items per
// thread (kThreads * kSortItems >= k); kCluster CTAs per row. vec: logits and stride allow
// 16-byte loads. Cluster c takes rows c, c + clusters, ... (one row where the grid has a cluster a
// row), loading the next one while it selects the current one.
template <int kItems, int kSortItems, int kCluster, int kMode>
__global__ void __launch_bounds__(kThreads, kItems <= 16 ? 2 : 1)
TopkKernel(const float* __restrict__ logits, int64_t stride, const int* __restrict__ lo,
           const int* __restrict__ hi, int rows, int cols, int k, bool vec, int* __restrict__ out,
           Split split) {
  constexpr int kQuads = kItems / 4;   // a thread's float4s
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sh = *reinterpret_cast<Shared<kItems, kSortItems>*>(smem_raw);
  const int tid = threadIdx.x;
  int rank = 0;
  if constexpr (kCluster > 1) rank = static_cast<int>(cg::this_cluster().block_rank());
  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  const int lane = tid & 31;
  const int seg = rank * kThreads * kItems + (tid - lane) * kItems;   // the warp's first column
  const int first = seg + lane * kItems;                              // this thread's first
  float4* stage = sh.stage + (tid - lane) * kQuads;

  if constexpr (kCluster == 1) {   // FindBin keeps them zeroed from here on
    for (int t = tid; t < 2 * kBins; t += kThreads) sh.hist[t / kBins][t % kBins] = 0;
    __syncthreads();
  }
  int row = static_cast<int>(blockIdx.x) / kCluster;
  Range next{0, 0};
  if (row < rows) {
    const Part p = Locate<kMode>(logits, stride, lo, hi, row, cols, split);
    next = p.r;
    StartLoad<kItems>(stage, p.x, p.r, seg, lane, vec);
  }
#pragma unroll 1
  for (; row < rows; row += clusters) {
    const int begin = next.begin, end = next.end;
#ifdef TOPK_PHASES
    long long mark_ = clock64();
#endif

    // --- this thread's keys (0: not a candidate): columns first .. first + kItems - 1, each lane
    // taking its kItems consecutive ones from the warp's stage.
    CopyAsyncWait();
    __syncwarp();
    TOPK_MARK(0);   // the row's logits arrived
    uint32_t key[kItems];
    // columns outside [begin, end) only where this thread's columns cross a bound
    if (first >= begin && first + kItems <= end) {   // no bound to check (most threads)
#pragma unroll
      for (int v = 0; v < kQuads; ++v) {
        const int q = lane * kQuads + v;
        const float4 f4 = stage[q ^ ((q >> 3) & 7)];
        key[4 * v] = CandidateKey(f4.x);
        key[4 * v + 1] = CandidateKey(f4.y);
        key[4 * v + 2] = CandidateKey(f4.z);
        key[4 * v + 3] = CandidateKey(f4.w);
      }
    } else {
#pragma unroll
      for (int v = 0; v < kQuads; ++v) {
        const int q = lane * kQuads + v;
        const float4 f4 = stage[q ^ ((q >> 3) & 7)];
        const float f[4] = {f4.x, f4.y, f4.z, f4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = first + 4 * v + e;
          key[4 * v + e] = c >= begin && c < end ? CandidateKey(f[e]) : 0u;
        }
      }
    }
    const int next_row = row + clusters;
    __syncwarp();   // every lane has read the warp's stage
    if (next_row < rows) {
      const Part p = Locate<kMode>(logits, stride, lo, hi, next_row, cols, split);
      next = p.r;
      StartLoad<kItems>(stage, p.x, p.r, seg, lane, vec);
    }
    TOPK_MARK(1);   // keys made (and the next row's copies started)

    // --- radix select: the digits of the k-th largest key (11, 11, 10 bits) ------------------
    uint32_t prefix = 0, mask = 0;   // the digits found so far
    int above = 0;                   // keys certainly taken (above the digits found)
    int need = k;                    // taken among the keys that match them: the first need
    bool cut = false;                // ties at the threshold must be cut (in column order)
    int top = kBins - 1;             // the highest candidate's first digit
    bool found;                      // the selection is known
    {  // the first pass: every key, no branch (key 0 lands in bin 0, which FindBin skips)
      uint32_t* hist = sh.hist[0];
      if constexpr (kCluster > 1) ZeroBins(hist);   // (one CTA: FindBin left it zeroed)
#pragma unroll
      for (int j = 0; j < kItems; ++j) atomicAdd(&hist[key[j] >> 21], 1u);
      const Found f = FindBin<kCluster>(sh, hist, need, rank, true);
      TOPK_MARK(2);   // the first pass
      if (f.total > 0) top = f.top;
      if (f.total <= static_cast<uint32_t>(k)) {   // every candidate is taken
        above = static_cast<int>(f.total);
        need = 0;
        prefix = 1;   // every candidate's key is >= 1
        found = true;
      } else {
        above = f.above;
        need -= f.above;
        prefix = static_cast<uint32_t>(f.bin) << 21;
        mask = 0x7ffu << 21;
        found = f.count == need;   // the whole bin is taken: no tie to cut
      }
    }
#pragma unroll 1
    for (int pass = 1; pass < 3 && !found; ++pass) {   // the keys that match the digits found
      const int shift = pass == 1 ? 10 : 0;
      const uint32_t digit = pass == 2 ? 0x3ffu : 0x7ffu;
      uint32_t* hist = sh.hist[pass & 1];
      if constexpr (kCluster > 1) ZeroBins(hist);
      // (a predicated red.shared in place of the branch measured no faster)
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if ((key[j] & mask) == prefix) atomicAdd(&hist[(key[j] >> shift) & digit], 1u);
      }
      const Found f = FindBin<kCluster>(sh, hist, need, rank, false);
      above += f.above;
      need -= f.above;
      prefix |= static_cast<uint32_t>(f.bin) << shift;
      mask |= digit << shift;
      found = f.count == need;     // the whole bin is taken: no tie to cut
      cut = pass == 2 && !found;   // all 32 bits found and equal keys left over
    }
    const int selected = above + need;
    TOPK_MARK(3);   // the later passes

    // --- slots, in column order --------------------------------------------------------------
    // Without a cut the selection is key >= prefix (prefix's low bits are 0, so key & mask >=
    // prefix says the same); with one, the keys above it and the first `need` equal to it.
    int* scol = InRank<kCluster>(sh.col, 0);
    uint32_t* skey = nullptr;
    if constexpr (kSortItems > 0) skey = InRank<kCluster>(sh.key, 0);
    if (!cut) {
      uint32_t mine = 0;
#pragma unroll
      for (int j = 0; j < kItems; ++j) mine += key[j] >= prefix;
      uint32_t slot, cta_total;
      Scan(sh.scan).ExclusiveSum(mine, slot, cta_total);   // FindBin ended with a barrier
      if constexpr (kCluster > 1) {   // add the lower ranks' counts
        if (tid == 0) sh.cta_total = cta_total;
        Sync<kCluster>();
        for (int r = 0; r < rank; ++r) slot += *cg::this_cluster().map_shared_rank(&sh.cta_total, r);
      }
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (key[j] >= prefix) {
          if constexpr (kSortItems > 0) skey[slot] = key[j];
          scol[slot] = first + j;
          ++slot;
        }
      }
    } else {
      uint32_t mine = 0;   // packed (above | equal << 16) among this thread's keys
#pragma unroll
      for (int j = 0; j < kItems; ++j) mine += key[j] > prefix ? 1u : key[j] == prefix ? 1u << 16 : 0u;
      uint32_t packed, cta_total;
      Scan(sh.scan).ExclusiveSum(mine, packed, cta_total);
      if constexpr (kCluster > 1) {
        if (tid == 0) sh.cta_total = cta_total;
        Sync<kCluster>();
      }
      int n_above = static_cast<int>(packed & 0xffff), equal = static_cast<int>(packed >> 16);
      if constexpr (kCluster > 1) {
        for (int r = 0; r < rank; ++r) {   // unpacked: a whole row's equal keys may pass 65535
          const uint32_t t = *cg::this_cluster().map_shared_rank(&sh.cta_total, r);
          n_above += static_cast<int>(t & 0xffff);
          equal += static_cast<int>(t >> 16);
        }
      }
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        int slot = -1;
        if (key[j] > prefix) {
          slot = n_above + min(equal, need);
          ++n_above;
        } else if (key[j] == prefix) {
          if (equal < need) slot = n_above + equal;
          ++equal;
        }
        if (slot >= 0) {
          if constexpr (kSortItems > 0) skey[slot] = key[j];
          scol[slot] = first + j;
        }
      }
    }

    // The cluster's first CTA gathers the selected columns (and keys, to sort), then writes the
    // row's output coalesced.
    if constexpr (kSortItems == 0) {
      Sync<kCluster>();   // every slot is written (and peers are done reading sh.cta_total)
      TOPK_MARK(4);       // slots
      if (rank == 0) WriteRow<kMode>(sh.col, selected, k, row, logits, stride, split, out);
    } else {
      constexpr int kSlots = kThreads * kSortItems;
      if (rank == 0) {
        for (int t = selected + tid; t < kSlots; t += kThreads) {
          sh.key[t] = prefix;   // sorts after every selected key (ties keep their place: last)
          sh.col[t] = -1;
        }
      }
      Sync<kCluster>();
      TOPK_MARK(4);   // slots
      if (rank == 0) {
        // Every selected key lies in [prefix, top_key]: the sort looks at the significant bits of
        // key - prefix only.
        const uint32_t top_key = static_cast<uint32_t>(((static_cast<uint64_t>(top) + 1) << 21) - 1);
        const uint32_t spread = top_key - prefix;
        const int end_bit = spread == 0 ? 1 : 32 - __clz(spread);
        // The bucket sort where it measured faster (RESULTS.md, session 8: 1.27x at [2048, 8192]
        // k 512 and 2048); at k 4096 or past 32768 keys a row its buckets fill up (0.66-0.96x).
        if constexpr (kSortItems <= 4 && kThreads * kItems * kCluster <= 32768) {
          // (one CTA: the selection left hist[0] zeroed, and the sort needs no zeroing pass)
          if (!BucketSort<kSortItems>(sh, selected, prefix, end_bit, kCluster == 1)) RadixSort<kSortItems>(sh, prefix, end_bit);
          if constexpr (kCluster == 1) {   // its counts were the histograms: zero again
            if (next_row < rows) {
#pragma unroll
              for (int j = 0; j < kBinsPerThread; ++j) sh.hist[0][tid + j * kThreads] = sh.hist[1][tid + j * kThreads] = 0;
              __syncthreads();
            }
          }
        } else {
          RadixSort<kSortItems>(sh, prefix, end_bit);
        }
        TOPK_MARK(5);   // the sort
        WriteRow<kMode>(sh.col, selected, k, row, logits, stride, split, out);
      }
    }
    TOPK_MARK(6);   // the output written
#ifdef TOPK_PHASES
    if (threadIdx.x == 0 && rank == 0) atomicAdd(&g_topk_phases[7], 1ull);
#endif
  }  // rows
}

// The persistent grid: 2 clusters an SM (for single-CTA rows of 16 keys a thread, as many CTAs as
// the SMs hold; larger clusters are cycled through the SMs by the hardware), each taking every
// so many rows: the grid topk_shapes.cu measured.
constexpr int kPersistentClustersPerSm = 2;

// grid: 0 one cluster a row; 1 persistent, kPersistentClustersPerSm clusters an SM, each taking
// every so many rows; n > 1 persistent with n clusters (tuning, and few-row sanitizer runs that
// still cross rows).
// The current device's SM count (host work only: capture-safe).
cudaError_t SmCount(int* sms) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  return e;
}

// rows: the grid's rows (a split row's chunks each count).
template <int kItems, int kSortItems, int kCluster, int kMode = kRows>
int Launch(const float* logits, int64_t stride, const int* lo, const int* hi, int rows, int cols,
           int k, bool vec, int* out, int grid, const Split& split, cudaStream_t stream) {
  auto* kernel = TopkKernel<kItems, kSortItems, kCluster, kMode>;
  constexpr size_t smem = sizeof(Shared<kItems, kSortItems>);
  static const cudaError_t opted_in = [&] {   // above 48 KiB, once per instantiation
    return smem > 48 * 1024 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem))
                            : cudaSuccess;
  }();
  if (opted_in != cudaSuccess) return static_cast<int>(opted_in);
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = kCluster > 1 ? 1 : 0;
  int clusters = grid > 1 ? std::min(rows, grid) : rows;
  if (grid == 1) {
    int sms = 0;
    const cudaError_t e = SmCount(&sms);
    if (e != cudaSuccess) return static_cast<int>(e);
    clusters = std::min(rows, kPersistentClustersPerSm * sms);
  }
  config.gridDim = dim3(static_cast<unsigned>(clusters) * kCluster);
  return static_cast<int>(cudaLaunchKernelEx(&config, kernel, logits, stride, lo, hi, rows, cols, k, vec, out, split));
}

template <int kItems, int kCluster, int kMode = kRows>
int LaunchSorted(int sort_items, const float* logits, int64_t stride, const int* lo, const int* hi,
                 int rows, int cols, int k, bool vec, int* out, int grid, const Split& split,
                 cudaStream_t stream) {
  switch (sort_items) {
    case 0: return Launch<kItems, 0, kCluster, kMode>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 1: return Launch<kItems, 1, kCluster, kMode>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 2: return Launch<kItems, 2, kCluster, kMode>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 4: return Launch<kItems, 4, kCluster, kMode>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    default: return Launch<kItems, 8, kCluster, kMode>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
  }
}

// A split's launch (one CTA a grid row): kChunks unsorted, kCandidates either.
template <int kItems>
int LaunchSplit(int mode, int sort_items, const float* logits, int64_t stride, const int* lo, const int* hi,
                int rows, int cols, int k, bool vec, int* out, int grid, const Split& split,
                cudaStream_t stream) {
  if (mode == kChunks) {
    return Launch<kItems, 0, 1, kChunks>(logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
  }
  return LaunchSorted<kItems, 1, kCandidates>(sort_items, logits, stride, lo, hi, rows, cols, k, vec, out,
                                              grid, split, stream);
}

// As JaxDgTopkRowsShaped, or a split's launch (mode; kChunks: split.chunks grid rows a logits row,
// unsorted; one CTA a grid row).
int RowsShaped(const float* logits, int64_t stride, const int* lo, const int* hi, int rows, int cols,
               int k, int sorted, int* out, int items, int cluster_size, int grid, Mode mode,
               const Split& split, cudaStream_t stream) {
  const int64_t part = mode == kChunks ? split.chunk_cols : cols;   // a grid row's columns
  if (mode != kRows && (cluster_size != 1 || (mode == kChunks && (sorted || split.chunks < 1)))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (k > kMaxK || grid < 0 || cluster_size < 1 || cluster_size > kMaxCluster ||
      static_cast<int64_t>(items) * cluster_size * kThreads < part ||
      (mode == kChunks && static_cast<int64_t>(rows) * split.chunks > INT32_MAX)) {
    return static_cast<int>(cudaErrorInvalidValue);   // (and the switch below: built shapes only)
  }
  int s = 0;   // the sort's items per thread (0: unsorted)
  if (sorted) {
    s = 1;
    while (s * kThreads < k) s *= 2;
  }
  // (a chunk starts at a multiple of 4 columns: jax_dg_topk::ChunkCols)
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && stride % 4 == 0;
  if (mode != kRows) {
    if (mode == kChunks) rows *= split.chunks;
    switch (items) {
      case 8: return LaunchSplit<8>(mode, s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
      case 16: return LaunchSplit<16>(mode, s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
      case 32: return LaunchSplit<32>(mode, s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
      case 64: return LaunchSplit<64>(mode, s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  switch (items * 16 + cluster_size) {
    case 8 * 16 + 1: return LaunchSorted<8, 1>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 16 * 16 + 1: return LaunchSorted<16, 1>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 32 * 16 + 1: return LaunchSorted<32, 1>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 32 * 16 + 2: return LaunchSorted<32, 2>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 32 * 16 + 4: return LaunchSorted<32, 4>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 32 * 16 + 8: return LaunchSorted<32, 8>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 64 * 16 + 1: return LaunchSorted<64, 1>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 64 * 16 + 2: return LaunchSorted<64, 2>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 64 * 16 + 4: return LaunchSorted<64, 4>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    case 64 * 16 + 8: return LaunchSorted<64, 8>(s, logits, stride, lo, hi, rows, cols, k, vec, out, grid, split, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

extern "C" int JaxDgTopkMaxK() { return kMaxK; }

#ifdef TOPK_PHASES
// The phase counters (cycles summed over rows; [7] the rows), then zeroed.
extern "C" int JaxDgTopkPhases(unsigned long long* host) {
  cudaError_t e = cudaMemcpyFromSymbol(host, g_topk_phases, sizeof(g_topk_phases));
  const unsigned long long zero[16] = {};
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(g_topk_phases, zero, sizeof(zero));
  return static_cast<int>(e);
}
#endif

// The kernel's shape for rows of `cols` keys: keys per thread and CTAs per row (a cluster).
// Measured on the H200 (benchmarks/topk_shapes.cu): a cluster costs more than it parallelises
// (at [4096, 32768], 32 keys a thread in clusters of 2 took 952 us, 16 in clusters of 4 1610
// and 8 in clusters of 8 6635), so rows take more keys a thread before they take more CTAs: up
// to 8192 keys, 16 a thread (2 CTAs an SM) beat 32 (1) by 2.5x; up to 32768, 64 a thread in one
// CTA beat 32 in a cluster of 2 by 1.6-1.8x (session 12: [4096, 32768] k 2048 396 us sorted, 276
// unsorted, against 718 and 496; at 64 rows within 3 % either way); past 32768, 64 a thread
// (at [64, 65536] k 2048: 64 x 2 CTAs 20 us, 32 x 4 52 us; at [256, 131072]: 64 x 4 232 us,
// 32 x 8 545 us; a split row, kernels/topk_split.h, beats both where JaxDgTopkSplits says).
// Returns 0 when a row is too long for a cluster (the long-row kernel takes it).
extern "C" int JaxDgTopkShape(int cols, int* items, int* cluster_size) {
  *items = cols <= 4096 ? 8 : cols <= 8192 ? 16 : cols <= 16384 ? 32 : 64;
  for (int c = 1; c <= kMaxCluster; c *= 2) {
    if (static_cast<int64_t>(c) * kThreads * *items >= cols) {
      *cluster_size = c;
      return 1;
    }
  }
  return 0;
}

// As JaxDgTopkRows with the kernel's shape given (items x cluster_size: 8 x 1, 16 x 1, 32 x 1,
// 2, 4 or 8, 64 x 1, 2, 4 or 8; their product times 512 >= cols), no split, and the grid (0 one
// cluster a row, 1 the persistent grid, n > 1 persistent with n clusters): for tuning and tests.
// Other shapes, or grid < 0, give cudaErrorInvalidValue.
extern "C" int JaxDgTopkRowsShaped(const float* logits, int64_t stride, const int* lo,
                                   const int* hi, int rows, int cols, int k, int sorted, int* out,
                                   int items, int cluster_size, int grid, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return 0;
  return RowsShaped(logits, stride, lo, hi, rows, cols, k, sorted, out, items, cluster_size, grid, kRows,
                    Split{}, stream);
}

// Rows split into chunks of at most chunk_cols keys (<= 32768: a chunk is one CTA;
// kernels/topk_split.h), two launches on `stream`. scratch: scratch_bytes of device memory,
// 16-byte aligned, at least jax_dg_topk::ScratchBytesOfChunks(rows, cols, k, chunk_cols).
// launches: 3 both, 1 the first only, 2 the second only (on the scratch the first left: for
// timing each). cudaErrorInvalidValue where the rows would not be split, or for a scratch too
// small. For tuning, and JaxDgTopkRows' long rows.
extern "C" int JaxDgTopkRowsSplit(const float* logits, int64_t stride, const int* lo, const int* hi,
                                  int rows, int cols, int k, int sorted, int* out, int chunk_cols,
                                  void* scratch, int64_t scratch_bytes, int launches,
                                  cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return 0;
  const int64_t chunks = jax_dg_topk::SplitChunks(cols, k, chunk_cols);
  if (chunks == 0 || k > kMaxK || chunk_cols > jax_dg_topk::kChunkCols || launches < 1 || launches > 3 ||
      reinterpret_cast<uintptr_t>(scratch) % 16 != 0 ||
      scratch_bytes < jax_dg_topk::ScratchBytesOfChunks(rows, cols, k, chunk_cols)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  Split first;   // each chunk's top k (column order), as candidates
  first.chunks = static_cast<int>(chunks);
  first.chunk_cols = static_cast<int>(jax_dg_topk::ChunkCols(cols, chunks));
  first.vals = static_cast<float*>(scratch);
  const int64_t candidates = chunks * k;   // a row's
  int* cand_cols = reinterpret_cast<int*>(first.vals + rows * candidates);
  int items = 0, cluster_size = 0;
  JaxDgTopkShape(first.chunk_cols, &items, &cluster_size);   // always fits: one CTA (<= kChunkCols)
  if (launches & 1) {
    const int e = RowsShaped(logits, stride, lo, hi, rows, cols, k, 0, cand_cols, items, cluster_size, 1,
                             kChunks, first, stream);
    if (e != 0 || !(launches & 2)) return e;
  }
  Split second;   // the row's top k among its candidates (-inf past a chunk's: never taken)
  second.cand_cols = cand_cols;
  JaxDgTopkShape(static_cast<int>(candidates), &items, &cluster_size);   // always fits: <= kMaxCandidates
  return RowsShaped(first.vals, candidates, nullptr, nullptr, rows, static_cast<int>(candidates), k,
                    sorted, out, items, cluster_size, 1, kCandidates, second, stream);
}

// Whether JaxDgTopkRows splits [rows, cols] rows given the scratch: 1 yes, 0 no, -(a CUDA error)
// where the device could not be asked. Where kernels/topk_split.h gives a scratch, except sorted
// rows of 2 chunks whose clusters of 2 would all run at once (2 x rows <= SMs, one CTA an SM):
// there the cluster's one launch beats the split's two (H200, topk_shapes.cu `split`: sorted
// [64, 65536] 0.81-1.00x for the split, [128, 65536] 1.00-1.13x; rows of 4 or 8 chunks
// 1.06-1.58x).
extern "C" int JaxDgTopkSplits(int rows, int cols, int k, int sorted) {
  const int64_t chunks = jax_dg_topk::SplitChunksFor(cols, k, sorted != 0);
  if (chunks != 2) return chunks > 0 ? 1 : 0;
  int sms = 0;
  const cudaError_t e = SmCount(&sms);
  if (e != cudaSuccess) return -static_cast<int>(e);
  return 2 * static_cast<int64_t>(rows) > sms ? 1 : 0;
}

// Launches on `stream`; returns a CUDA error code (0: success). scratch: scratch_bytes of device
// memory, 16-byte aligned, that rows of more than 32768 keys are split with where it holds
// jax_dg_topk::ScratchBytes(rows, cols, k, sorted) and JaxDgTopkSplits says so (else they take a
// cluster a row, or the long-row kernel).
extern "C" int JaxDgTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, void* scratch,
                             int64_t scratch_bytes, cudaStream_t stream) {
  const int64_t need = jax_dg_topk::ScratchBytes(rows, cols, k, sorted != 0);
  if (need > 0 && scratch_bytes >= need && reinterpret_cast<uintptr_t>(scratch) % 16 == 0) {
    const int split = JaxDgTopkSplits(rows, cols, k, sorted);
    if (split < 0) return -split;
    if (split) {
      return JaxDgTopkRowsSplit(logits, stride, lo, hi, rows, cols, k, sorted, out,
                                static_cast<int>(jax_dg_topk::kChunkCols), scratch, scratch_bytes, 3,
                                stream);
    }
  }
  int items = 0, cluster_size = 0;
  if (!JaxDgTopkShape(cols, &items, &cluster_size)) {
    return JaxDgTopkLongRows(logits, stride, lo, hi, rows, cols, k, sorted, out, stream);
  }
  // The persistent grid (loading the next row during this one) where that measured faster (H200,
  // topk_shapes.cu): unsorted rows, and sorted rows of one CTA (session 12's kernel: at [4096,
  // 32768] 64 x 1 k 2048 unsorted 273 us against 294 a CTA a row, sorted 375 against 397; at
  // [2048, 8192] 16 x 1 k 2048 46.2 against 47.6 unsorted, sorted within 1 % either way; equal
  // at [256, 8192]). Sorted rows split over a cluster are faster a cluster a row, the hardware
  // refilling the SMs as soon as one finishes: a persistent cluster's other CTAs would wait
  // through rank 0's sort (at [4096, 32768] 32 x 2, session 11: 718 against 794 us; at [64,
  // 65536] and [256, 131072] equal).
  const int persistent = !sorted || cluster_size == 1;
  return JaxDgTopkRowsShaped(logits, stride, lo, hi, rows, cols, k, sorted, out, items,
                             cluster_size, persistent, stream);
}
