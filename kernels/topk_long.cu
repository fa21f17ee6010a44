// jax_dg's top-k for rows longer than kernels/topk.cu's clusters hold (> 262144 keys): the
// same contract, slower (one CTA per row, each radix pass re-reads the row from L2).
//
// One CTA per row. A radix select over the order-preserving uint32 key of each float finds
// the k-th largest key in at most four 8-bit passes over the row (each pass only counts keys
// that share the digits found so far). Rows of up to 40960 keys are read from global memory
// once and staged in shared memory; longer rows are re-read (from L2) by each pass. Then one
// pass collects, in column order, the keys above that threshold and the first keys equal to
// it. Sorted, a bitonic sort orders them by value descending, index ascending on ties
// (lax.top_k's documented order): its stages with step < 64 in registers (warp shuffles), the
// wider ones in shared memory. Unsorted, the same set stays in column order
// (no sort). Either way the result is the same on every run.
//
// Candidates of row r: columns c with lo[r] <= c < hi[r] (all when lo/hi are null), c < cols,
// and logits > -inf (NaN is not a candidate). Slots past the number of candidates get -1.

#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kHistCopies = 8;   // histogram copies (4 warps each) to spread atomics
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxCached = 40960;   // keys (160 KiB) of a row staged in shared memory

__device__ __forceinline__ uint32_t OrderKey(float v) {
  uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The row's candidate keys: from shared memory when the row was staged there, else from
// global memory (L2 after the first pass). 0 marks a non-candidate (every candidate's key is
// >= OrderKey(-FLT_MAX) > 0).
struct Row {
  const float* x;
  const uint32_t* cache;   // nullptr: not staged
  int begin, end;
  __device__ __forceinline__ uint32_t Key(int i) const {
    if (cache != nullptr) return cache[i - begin];
    const float v = x[i];
    return v > -INFINITY ? OrderKey(v) : 0u;
  }
};

// (key, idx) a goes before b: larger key first, then the smaller index.
__device__ __forceinline__ bool Before(uint32_t ka, int ia, uint32_t kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Compare-exchange of one register slot with lane (lane ^ step)'s: slot index i, in a bitonic
// run of `size` (our order where i & size == 0, reversed elsewhere).
__device__ __forceinline__ void ShuffleStage(uint32_t& key, int& idx, int i, int lane, int step,
                                             int size) {
  const uint32_t pk = __shfl_xor_sync(0xffffffffu, key, step);
  const int pi = __shfl_xor_sync(0xffffffffu, idx, step);
  const bool lower = (lane & step) == 0;
  const bool down = (i & size) == 0;
  // The lower slot takes the element that goes first in this run's direction.
  if ((lower == down) != Before(key, idx, pk, pi)) {
    key = pk;
    idx = pi;
  }
}

// The bitonic stages with step < 64 of the sizes from `first` to min(64, first) .. : with
// first == 2, sizes 2..64 entirely; else the steps 32..1 of size `first`. Warp w sorts the
// 64-slot windows w, w + kWarps, ... in registers.
__device__ __forceinline__ void SortWindows(uint32_t* skey, int* sidx, int windows, int warp,
                                            int lane, int first) {
  for (int w = warp; w < windows; w += kWarps) {
    const int base = 64 * w;
    uint32_t k0 = skey[base + lane], k1 = skey[base + 32 + lane];
    int i0 = sidx[base + lane], i1 = sidx[base + 32 + lane];
    const int last = first == 2 ? 64 : first;
    for (int size = first; size <= last; size <<= 1) {
      int step = size >> 1;
      if (step > 32) step = 32;
      for (; step > 0; step >>= 1) {
        if (step == 32) {   // slots l and l + 32: both in this lane
          const bool down = ((base + lane) & size) == 0;
          if (Before(k0, i0, k1, i1) != down) {
            const uint32_t tk = k0; k0 = k1; k1 = tk;
            const int ti = i0; i0 = i1; i1 = ti;
          }
        } else {
          ShuffleStage(k0, i0, base + lane, lane, step, size);
          ShuffleStage(k1, i1, base + 32 + lane, lane, step, size);
        }
      }
    }
    skey[base + lane] = k0;
    skey[base + 32 + lane] = k1;
    sidx[base + lane] = i0;
    sidx[base + 32 + lane] = i1;
  }
}

__global__ void __launch_bounds__(kThreads)
TopkRowsKernel(const float* __restrict__ logits, int64_t stride, const int* __restrict__ lo,
               const int* __restrict__ hi, int cols, int k, int k_slots, int cache_cap,
               bool sorted, int* __restrict__ out) {
  extern __shared__ uint32_t smem[];
  uint32_t* hist = smem;                                 // kHistCopies * kBins
  uint32_t* skey = smem + kHistCopies * kBins;           // k_slots
  int* sidx = reinterpret_cast<int*>(skey + k_slots);     // k_slots
  uint32_t* cache = skey + 2 * k_slots;                   // cache_cap keys of the row
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_need, s_gt, s_eq_base, s_done, s_stop;
  __shared__ int s_bin, s_above, s_bin_count, s_total;
  __shared__ int warp_sums[kWarps];

  const int row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Row r;
  r.x = logits + static_cast<int64_t>(row) * stride;
  r.begin = lo ? max(lo[row], 0) : 0;
  r.end = hi ? min(hi[row], cols) : cols;
  if (r.end < r.begin) r.end = r.begin;
  r.cache = nullptr;
  if (r.end - r.begin <= cache_cap) {   // stage the row once: later passes read shared memory
#pragma unroll 8
    for (int i = r.begin + tid; i < r.end; i += kThreads) cache[i - r.begin] = r.Key(i);
    r.cache = cache;
  }

  if (tid == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_need = k;
    s_done = 0;
    s_stop = 0;
  }
  __syncthreads();

  // --- radix select: the digits of the k-th largest key, most significant first -----------
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kHistCopies * kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    uint32_t* my_hist = hist + (warp % kHistCopies) * kBins;
#pragma unroll 4
    for (int base = r.begin; base < r.end; base += kThreads) {   // warp-uniform trip count
      const int i = base + tid;
      uint32_t bin = kBins;   // not counted
      if (i < r.end) {
        const uint32_t key = r.Key(i);
        if (key != 0 && (key & mask) == prefix) bin = (key >> shift) & (kBins - 1);
      }
      const unsigned peers = __match_any_sync(kFull, bin);
      if (bin < kBins && lane == __ffs(peers) - 1) atomicAdd(&my_hist[bin], __popc(peers));
    }
    __syncthreads();
    if (warp == 0) {   // which bin holds the need-th largest: a scan from the top bin down
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int b = kBins - 1 - lane * 8 - j;
        uint32_t t = 0;
#pragma unroll
        for (int h = 0; h < kHistCopies; ++h) t += hist[h * kBins + b];
        c[j] = t;
        sum += t;
      }
      uint32_t inc = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t t = __shfl_up_sync(kFull, inc, o);
        if (lane >= o) inc += t;
      }
      const uint32_t exc = inc - sum;
      const uint32_t need = static_cast<uint32_t>(s_need);
      if (lane == 31) s_total = static_cast<int>(inc);
      if (exc < need && need <= inc) {
        uint32_t acc = exc;
        for (int j = 0; j < 8; ++j) {
          if (acc + c[j] >= need) {
            s_bin = kBins - 1 - lane * 8 - j;
            s_above = static_cast<int>(acc);
            s_bin_count = static_cast<int>(c[j]);
            break;
          }
          acc += c[j];
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      if (shift == 24 && s_total <= k) {   // k or fewer candidates: take them all
        s_need = s_total;
        s_done = 1;
      } else {
        s_need -= s_above;
        s_prefix |= static_cast<uint32_t>(s_bin) << shift;
        s_mask |= static_cast<uint32_t>(kBins - 1) << shift;
        if (s_bin_count == s_need) s_done = 1;   // the whole bin is taken: no ties to cut
      }
    }
    __syncthreads();
    if (s_done) break;
  }

  // --- collect, in column order: every key above the threshold and the first `need` equal
  // to it. An element's slot is (keys above it before it) + min(equal keys before it, need):
  // one packed block scan per chunk of kThreads columns, no atomics, the same every run.
  const uint32_t prefix = s_prefix, mask = s_mask;
  const int need = s_need;
  const int n_gt = mask == 0 ? 0 : k - need;   // mask 0: every candidate counts as "equal"
  if (sorted) {
    for (int i = tid; i < k_slots; i += kThreads) {
      skey[i] = 0;            // sorts after every candidate
      sidx[i] = 0x7fffffff;
    }
  }
  if (tid == 0) {
    s_gt = 0;
    s_eq_base = 0;
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1;
  for (int base = r.begin; base < r.end; base += kThreads) {
    const int i = base + tid;
    uint32_t key = 0;
    if (i < r.end) key = r.Key(i);
    const uint32_t m = key & mask;
    const bool gt = key != 0 && m > prefix;
    const bool eq = key != 0 && m == prefix;
    const unsigned gt_ballot = __ballot_sync(kFull, gt);
    const unsigned eq_ballot = __ballot_sync(kFull, eq);
    if (lane == 0) warp_sums[warp] = __popc(gt_ballot) | (__popc(eq_ballot) << 16);
    __syncthreads();
    if (warp == 0) {   // exclusive scan of the warps' packed (above, equal) counts
      const int c = warp_sums[lane];
      int inc = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(kFull, inc, o);
        if (lane >= o) inc += t;
      }
      warp_sums[lane] = inc - c;
      if (lane == 31) s_total = inc;
    }
    __syncthreads();
    if (gt || eq) {
      const int before = warp_sums[warp];
      const int gt_before = s_gt + (before & 0xffff) + __popc(gt_ballot & lanes_below);
      const int eq_before = s_eq_base + (before >> 16) + __popc(eq_ballot & lanes_below);
      if (gt || eq_before < need) {
        const int pos = gt_before + min(eq_before, need);
        skey[pos] = key;
        sidx[pos] = i;
      }
    }
    __syncthreads();
    if (tid == 0) {   // decided by one thread, read by all after the barrier
      s_gt += s_total & 0xffff;
      s_eq_base += s_total >> 16;
      s_stop = s_eq_base >= need && s_gt >= n_gt;
    }
    __syncthreads();
    if (s_stop) break;   // all found
  }
  __syncthreads();
  const int selected = n_gt + need;
  int* o = out + static_cast<int64_t>(row) * k;
  if (!sorted) {   // column order
    for (int t = tid; t < k; t += kThreads) o[t] = t < selected ? sidx[t] : -1;
    return;
  }

  // --- bitonic sort of the slots: value descending, index ascending -----------------------
  // Stages whose step is < 64 stay inside a 64-slot window: a warp runs them in registers
  // (lane l holds window slots l and l + 32; shuffles exchange). Only the stages with a
  // step >= 64 go through shared memory, one pair per thread, with block barriers.
  const int windows = k_slots / 64;
  SortWindows(skey, sidx, windows, warp, lane, 2);   // sizes 2..64 entirely in registers
  __syncthreads();
  for (int size = 128; size <= k_slots; size <<= 1) {
    for (int step = size >> 1; step >= 64; step >>= 1) {
      for (int t = tid; t < (k_slots >> 1); t += kThreads) {
        const int a = 2 * t - (t & (step - 1));
        const int b = a + step;
        const bool down = (a & size) == 0;   // this run sorts in our order, else reversed
        if (Before(skey[a], sidx[a], skey[b], sidx[b]) != down) {
          const uint32_t tk = skey[a];
          skey[a] = skey[b];
          skey[b] = tk;
          const int ti = sidx[a];
          sidx[a] = sidx[b];
          sidx[b] = ti;
        }
      }
      __syncthreads();
    }
    SortWindows(skey, sidx, windows, warp, lane, size);   // this size's steps 32..1
    __syncthreads();
  }
  __syncthreads();
  for (int t = tid; t < k; t += kThreads) o[t] = t < selected ? sidx[t] : -1;
}

}  // namespace

// Launches on `stream`; returns a CUDA error code (0: success). k <= 4096.
int JaxDgTopkLongRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return 0;
  if (k > 4096) return static_cast<int>(cudaErrorInvalidValue);
  int k_slots = 64;   // a power of two >= k, at least one warp's 64-slot window
  while (k_slots < k) k_slots <<= 1;
  // Stage rows of up to kMaxCached keys in shared memory (two CTAs per SM still fit for rows
  // of 8k keys; a 32k-key row takes one SM's worth); longer rows are read from L2 per pass.
  const int cache_cap = cols <= kMaxCached ? cols : 0;
  const size_t smem = (kHistCopies * kBins + 2 * static_cast<size_t>(k_slots) +
                       static_cast<size_t>(cache_cap)) * sizeof(uint32_t);
  // The 48 KiB default covers static and dynamic shared memory together: above it, opt in
  // (the attribute stays set for the function, so counting only the dynamic part failed just
  // when no earlier, larger launch in the process had opted in: k 1024 over 8192 keys).
  static const size_t static_smem = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, TopkRowsKernel) == cudaSuccess ? a.sharedSizeBytes : 0;
  }();
  if (smem + static_smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(TopkRowsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  TopkRowsKernel<<<rows, kThreads, smem, stream>>>(logits, stride, lo, hi, cols, k, k_slots,
                                                   cache_cap, sorted != 0, out);
  return static_cast<int>(cudaGetLastError());
}
