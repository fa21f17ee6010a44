// jax_dg's own CUDA kernel: -inf at the logits positions outside each row's valid range, written
// in place after DeepGEMM's logits kernel (the logits ops' `clean_logits=True`).
//
// DeepGEMM leaves those positions unwritten (stale memory) or holding scores of keys outside the
// row's range. Writing them here, and only them, makes every element of the returned [rows, cols]
// block defined in memory: the view that cuts it out of the padded buffer is then a plain slice,
// and nothing downstream reads memory no kernel wrote (what compute-sanitizer's initcheck
// checks). Row r's valid columns are [lo[r], hi[r]) (lo null: 0), or with `relative`
// [0, hi[r] - lo[r]) (the compressed form, whose column t holds key lo[r] + t); both ends clamped
// to [0, cols]. Only stores: the valid columns are neither read nor written. No allocation, one
// launch on the given stream.

#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxCtas = 132 * 8;   // H200: 132 SMs; rows beyond this loop

template <typename Bits>
__global__ void __launch_bounds__(kThreads)
NegInfOutside(Bits* __restrict__ logits, int64_t stride, int rows, int cols,
              const int* __restrict__ lo, const int* __restrict__ hi, bool relative, Bits neg_inf) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    int a = lo != nullptr ? lo[r] : 0;
    int b = hi[r];
    if (relative) {
      b = b - a;   // ks <= ke <= N (the op clamps them), so no overflow
      a = 0;
    }
    a = min(max(a, 0), cols);
    b = min(max(b, a), cols);
    Bits* row = logits + static_cast<int64_t>(r) * stride;
    for (int c = threadIdx.x; c < a; c += kThreads) row[c] = neg_inf;
    for (int c = b + threadIdx.x; c < cols; c += kThreads) row[c] = neg_inf;
  }
}

}  // namespace

// elem_bytes 4: float32 logits (-inf = 0xff800000); 2: bfloat16 (0xff80).
extern "C" int JaxDgNegInfOutside(void* logits, int64_t stride, int elem_bytes, int rows, int cols,
                                  const int* lo, const int* hi, int relative, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return 0;
  const int ctas = rows < kMaxCtas ? rows : kMaxCtas;
  if (elem_bytes == 4) {
    NegInfOutside<uint32_t><<<ctas, kThreads, 0, stream>>>(
        static_cast<uint32_t*>(logits), stride, rows, cols, lo, hi, relative != 0, 0xff800000u);
  } else if (elem_bytes == 2) {
    NegInfOutside<uint16_t><<<ctas, kThreads, 0, stream>>>(
        static_cast<uint16_t*>(logits), stride, rows, cols, lo, hi, relative != 0,
        static_cast<uint16_t>(0xff80u));
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}
