// jax_dg's top-k (kernels/topk.cu, kernels/topk_long.cu) as typed XLA FFI handlers: the CUDA
// launch and its C++ twin on CPU, bitwise equal.
//
// out[r] (int32 [rows, k]) = the columns of row r's k largest logits among lo[r] <= c <
// min(hi[r], cols) with logits > -inf (NaN never), value descending then column ascending
// (+0.0 above -0.0), or (unsorted) the same set in column order; -1 past the candidates.
// logits float32 [R, S]: rows <= R, cols <= S (S is the row stride). lo, hi: int32 [rows], or
// [0] with has_lo / has_hi false (absent: the custom call keeps one signature, no fill kernel).
// scratch: uint8 [rows, jax_dg_topk::ScratchBytes(1, cols, k, sorted)] (kernels/topk_split.h;
// [rows, 0] where rows are never split), for the CUDA kernel's long rows; the CPU does not
// touch it.

#include <functional>
#include <vector>

#include "handlers.h"
#include "../kernels/topk_split.h"

#ifdef JAX_DG_CUDA
extern "C" int JaxDgTopkMaxK();
extern "C" int JaxDgTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, void* scratch,
                             int64_t scratch_bytes, cudaStream_t stream);
#endif

namespace jax_dg_native {

constexpr int kMaxK = 4096;   // kernels/topk.cu's limit (JaxDgTopkMaxK), the CPU's too

int TopkMaxK() {
#ifdef JAX_DG_CUDA
  return JaxDgTopkMaxK();
#else
  return kMaxK;
#endif
}

int64_t TopkScratchBytes(int64_t cols, int64_t k, bool sorted) {
  return jax_dg_topk::ScratchBytes(1, cols, k, sorted);
}

namespace {

// kernels/topk.cu's OrderKey: an unsigned key in the float's total order (+0.0 above -0.0).
uint32_t OrderKey(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Topk {
  struct Params {
    const float* logits;
    int64_t stride;
    const int32_t* lo;   // nullptr: absent
    const int32_t* hi;
    int rows, cols, k;
    bool sorted;
    int32_t* out;
    void* scratch;
    int64_t scratch_bytes;
  };

  static ffi::Error Plan(Params* p, ffi::Buffer<ffi::F32, 2> logits, ffi::Buffer<ffi::S32, 1> lo,
                         ffi::Buffer<ffi::S32, 1> hi, ffi::ResultBuffer<ffi::S32, 2> out,
                         ffi::ResultBuffer<ffi::U8, 2> scratch, int64_t cols, bool sorted,
                         bool has_lo, bool has_hi) {
    const char* name = "topk";
    auto ld = logits.dimensions(), od = out->dimensions();
    const int64_t rows = od[0], k = od[1];
    if (k > kMaxK) return Invalid(name, "k = " + std::to_string(k) + " > " + std::to_string(kMaxK));
    if (!FitsInt(rows) || rows > ld[0]) {
      return Invalid(name, "output rows " + std::to_string(rows) + " exceed logits " + Dims(ld));
    }
    if (!FitsInt(cols) || cols > ld[1]) {
      return Invalid(name, "cols = " + std::to_string(cols) + " outside [0, " +
                               std::to_string(ld[1]) + "] (logits " + Dims(ld) + ")");
    }
    if (has_lo && static_cast<int64_t>(lo.element_count()) < rows) {
      return Invalid(name, "lo has " + std::to_string(lo.element_count()) + " elements, rows = " +
                               std::to_string(rows));
    }
    if (has_hi && static_cast<int64_t>(hi.element_count()) < rows) {
      return Invalid(name, "hi has " + std::to_string(hi.element_count()) + " elements, rows = " +
                               std::to_string(rows));
    }
    auto sd = scratch->dimensions();
    const int64_t scratch_row = TopkScratchBytes(cols, k, sorted);
    if (sd[0] != rows || sd[1] != scratch_row) {   // the shape rule (jax_dg.core.native.topk)
      return Invalid(name, "scratch " + Dims(sd) + ", expected [" + std::to_string(rows) + ", " +
                               std::to_string(scratch_row) + "]");
    }
    *p = Params{logits.typed_data(), ld[1], has_lo ? lo.typed_data() : nullptr,
                has_hi ? hi.typed_data() : nullptr, static_cast<int>(rows), static_cast<int>(cols),
                static_cast<int>(k), sorted, out->typed_data(), scratch->untyped_data(),
                static_cast<int64_t>(scratch->size_bytes())};
    return ffi::Error::Success();
  }

  static ffi::Error Cpu(const Params& p) {
    return Guarded("topk", [&] { Rows(p); });
  }

  static void Rows(const Params& p) {
    if (p.k == 0) return;
    // (key << 32 | ~column): one descending order is value descending, column ascending, and
    // every entry is distinct, so the top k is one set whatever the selection algorithm.
    std::vector<uint64_t> cand;
    std::vector<int32_t> cols;
    for (int r = 0; r < p.rows; ++r) {
      const float* x = p.logits + static_cast<int64_t>(r) * p.stride;
      const int begin = p.lo ? std::max(p.lo[r], 0) : 0;
      int end = p.hi ? std::min(p.hi[r], p.cols) : p.cols;
      if (end < begin) end = begin;
      cand.clear();
      for (int c = begin; c < end; ++c) {
        if (x[c] > -INFINITY) {
          cand.push_back(static_cast<uint64_t>(OrderKey(x[c])) << 32 | static_cast<uint32_t>(~c));
        }
      }
      const size_t take = std::min(cand.size(), static_cast<size_t>(p.k));
      if (take < cand.size()) {
        std::nth_element(cand.begin(), cand.begin() + take, cand.end(), std::greater<uint64_t>());
      }
      auto column = [](uint64_t e) { return static_cast<int32_t>(~static_cast<uint32_t>(e)); };
      int32_t* o = p.out + static_cast<int64_t>(r) * p.k;
      if (p.sorted) {
        std::sort(cand.begin(), cand.begin() + take, std::greater<uint64_t>());
        for (size_t t = 0; t < take; ++t) o[t] = column(cand[t]);
      } else {
        cols.resize(take);
        for (size_t t = 0; t < take; ++t) cols[t] = column(cand[t]);
        std::sort(cols.begin(), cols.end());
        std::copy(cols.begin(), cols.end(), o);
      }
      std::fill(o + take, o + p.k, -1);
    }
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    return CudaStatus("topk", JaxDgTopkRows(p.logits, p.stride, p.lo, p.hi, p.rows, p.cols, p.k,
                                            p.sorted ? 1 : 0, p.out, p.scratch, p.scratch_bytes,
                                            stream));
  }
#endif

  template <typename B>
  static auto Bind(B b) {
    return std::move(b)
        .template Arg<ffi::Buffer<ffi::F32, 2>>()   // logits [R, S]
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // lo [rows] or [0]
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // hi [rows] or [0]
        .template Ret<ffi::Buffer<ffi::S32, 2>>()   // out [rows, k]
        .template Ret<ffi::Buffer<ffi::U8, 2>>()    // scratch [rows, bytes a row] (long rows)
        .template Attr<int64_t>("cols")
        .template Attr<bool>("sorted")
        .template Attr<bool>("has_lo")
        .template Attr<bool>("has_hi");
  }
};

}  // namespace
}  // namespace jax_dg_native

JAX_DG_NATIVE_HANDLERS(Topk, jax_dg_native::Topk);
