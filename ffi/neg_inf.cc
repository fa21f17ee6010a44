// jax_dg's -inf fill (kernels/neg_inf.cu) as typed XLA FFI handlers: the CUDA launch and its C++
// twin on CPU, bitwise equal.
//
// logits[r, c] := -inf for r < rows, c < cols outside [lo[r], hi[r]) (lo absent: 0), or with
// `relative` outside [0, hi[r] - lo[r]); both ends clamped to [0, cols]. Nothing else written.
// logits float32 or bfloat16 [R, S], in place: input 0 aliases the result. rows < 0: as many
// rows as hi has (a symbolic row count is known only here).

#include "handlers.h"

#ifdef JAX_DG_CUDA
extern "C" int JaxDgNegInfOutside(void* logits, int64_t stride, int elem_bytes, int rows, int cols,
                                  const int* lo, const int* hi, int relative, cudaStream_t stream);
#endif

namespace jax_dg_native {
namespace {

struct NegInf {
  struct Params {
    InPlace io;          // io.out: the result buffer (aliases the input)
    int64_t stride;
    int elem_bytes;
    int rows, cols;
    const int32_t* lo;   // nullptr: absent
    const int32_t* hi;
    bool relative;
  };

  static ffi::Error Plan(Params* p, ffi::AnyBuffer in, ffi::Buffer<ffi::S32, 1> lo,
                         ffi::Buffer<ffi::S32, 1> hi, ffi::Result<ffi::AnyBuffer> out,
                         int64_t rows, int64_t cols, bool relative, bool has_lo) {
    const char* name = "neg_inf_outside";
    auto dims = in.dimensions();
    const ffi::DataType t = in.element_type();
    if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
      return Invalid(name, "logits must be float32 or bfloat16");
    }
    if (dims.size() != 2) return Invalid(name, "logits must be [R, S], got " + Dims(dims));
    if (!SameLayout(in, *out)) {
      return Invalid(name, "the result must alias logits (same type and shape)");
    }
    if (rows < 0) rows = static_cast<int64_t>(hi.element_count());
    if (!FitsInt(rows) || rows > dims[0]) {
      return Invalid(name, "rows = " + std::to_string(rows) + " outside [0, " +
                               std::to_string(dims[0]) + "]");
    }
    if (!FitsInt(cols) || cols > dims[1]) {
      return Invalid(name, "cols = " + std::to_string(cols) + " outside [0, " +
                               std::to_string(dims[1]) + "]");
    }
    if (static_cast<int64_t>(hi.element_count()) < rows) {
      return Invalid(name, "hi has " + std::to_string(hi.element_count()) + " elements, rows = " +
                               std::to_string(rows));
    }
    if (has_lo && static_cast<int64_t>(lo.element_count()) < rows) {
      return Invalid(name, "lo has " + std::to_string(lo.element_count()) + " elements, rows = " +
                               std::to_string(rows));
    }
    *p = Params{InPlaceOf(in, *out), dims[1], static_cast<int>(ffi::ByteWidth(t)),
                static_cast<int>(rows), static_cast<int>(cols), has_lo ? lo.typed_data() : nullptr,
                hi.typed_data(), relative};
    return ffi::Error::Success();
  }

  template <typename Bits>
  static void Rows(const Params& p, Bits neg_inf) {
    for (int r = 0; r < p.rows; ++r) {
      int a = p.lo ? p.lo[r] : 0;
      int b = p.hi[r];
      if (p.relative) {   // int32 wrap-around, as the kernel's (and torch's) subtraction
        b = static_cast<int32_t>(static_cast<uint32_t>(b) - static_cast<uint32_t>(a));
        a = 0;
      }
      a = std::min(std::max(a, 0), p.cols);
      b = std::min(std::max(b, a), p.cols);
      Bits* row = static_cast<Bits*>(p.io.out) + static_cast<int64_t>(r) * p.stride;
      std::fill(row, row + a, neg_inf);
      std::fill(row + b, row + p.cols, neg_inf);
    }
  }

  static ffi::Error Cpu(const Params& p) {
    StartFromInputCpu(p.io);
    if (p.elem_bytes == 4) {
      Rows<uint32_t>(p, 0xff800000u);
    } else {
      Rows<uint16_t>(p, static_cast<uint16_t>(0xff80u));
    }
    return ffi::Error::Success();
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    const char* name = "neg_inf_outside";
    if (ffi::Error e = StartFromInputCuda(name, p.io, stream); e.failure()) return e;
    return CudaStatus(name, JaxDgNegInfOutside(p.io.out, p.stride, p.elem_bytes, p.rows, p.cols,
                                               p.lo, p.hi, p.relative ? 1 : 0, stream));
  }
#endif

  template <typename B>
  static auto Bind(B b) {
    return std::move(b)
        .template Arg<ffi::AnyBuffer>()             // logits [R, S], float32 or bfloat16
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // lo [rows] or [0]
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // hi [rows]
        .template Ret<ffi::AnyBuffer>()             // logits again (aliased)
        .template Attr<int64_t>("rows")
        .template Attr<int64_t>("cols")
        .template Attr<bool>("relative")
        .template Attr<bool>("has_lo");
  }
};

}  // namespace
}  // namespace jax_dg_native

JAX_DG_NATIVE_HANDLERS(NegInf, jax_dg_native::NegInf);
