// jax_dg's row zeroing of the grouped GEMMs (kernels/zero_rows.cu) as typed XLA FFI handlers:
// the CUDA launches and their C++ twins on CPU, bitwise equal. Both in place (input 0 aliases
// the result); a row (d's trailing dimensions) must be a multiple of 16 bytes.
//
// zero_masked_tail:  d [G, Mmax, ...]: rows masked_m[g] <= m < Mmax of group g := 0 (masked_m
//                    clamped to [0, Mmax]).
// zero_padding_rows: d [M, ...]: rows with layout[r] < 0 := 0, except, with skip_padding_blocks,
//                    in blocks of `block` rows whose first row's id is < 0 (left as they are).

#include "handlers.h"

#ifdef JAX_DG_CUDA
extern "C" int JaxDgZeroMaskedTail(void* d, int64_t row_bytes, int groups, int max_m,
                                   const int* masked_m, cudaStream_t stream);
extern "C" int JaxDgZeroPaddingRows(void* d, int64_t row_bytes, int rows, int block,
                                    const int* layout, int skip_padding_blocks,
                                    cudaStream_t stream);
#endif

namespace jax_dg_native {
namespace {

// Element types stored one or more whole bytes per element (the kernels write bytes).
bool WholeBytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::INVALID:
    case ffi::DataType::TOKEN:
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return false;
    default:
      return ffi::ByteWidth(t) > 0;
  }
}

// Bytes per row of d viewed as [rows_dims..., rest]; the kernels store 16 bytes at a time.
ffi::Error RowBytes(const char* name, const ffi::AnyBuffer& d, size_t lead, int64_t* row_bytes) {
  auto dims = d.dimensions();
  if (!WholeBytes(d.element_type())) return Invalid(name, "d's element type is not whole bytes");
  if (dims.size() < lead) return Invalid(name, "d has rank " + std::to_string(dims.size()));
  int64_t bytes = static_cast<int64_t>(ffi::ByteWidth(d.element_type()));
  for (size_t i = lead; i < dims.size(); ++i) bytes *= dims[i];
  if (bytes % 16 != 0) {
    return Invalid(name, "rows of d " + Dims(dims) + " are " + std::to_string(bytes) +
                             " bytes, not a multiple of 16");
  }
  *row_bytes = bytes;
  return ffi::Error::Success();
}

struct Rows {        // both kernels' parameters
  InPlace io;        // io.out: d, the result buffer (aliases the input)
  int64_t row_bytes;
  int groups, max_m;    // masked: G, Mmax
  int rows, block;      // padding: M, block
  const int32_t* ids;   // masked_m [G] or layout [M]
  bool skip;
  bool aligned;         // d's address is 16-byte aligned (the CUDA kernels' stores)
};

struct MaskedTail {
  using Params = Rows;

  static ffi::Error Plan(Params* p, ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> masked_m,
                         ffi::Result<ffi::AnyBuffer> out) {
    const char* name = "zero_masked_tail";
    int64_t row_bytes = 0;
    if (ffi::Error e = RowBytes(name, d, 2, &row_bytes); e.failure()) return e;
    if (!SameLayout(d, *out)) return Invalid(name, "the result must alias d (same type and shape)");
    auto dims = d.dimensions();
    if (!FitsInt(dims[0]) || !FitsInt(dims[1])) {
      return Invalid(name, "d " + Dims(dims) + " too large");
    }
    if (static_cast<int64_t>(masked_m.element_count()) < dims[0]) {
      return Invalid(name, "masked_m has " + std::to_string(masked_m.element_count()) +
                               " elements, groups = " + std::to_string(dims[0]));
    }
    *p = Rows{InPlaceOf(d, *out), row_bytes, static_cast<int>(dims[0]), static_cast<int>(dims[1]),
              0, 0, masked_m.typed_data(), false, Aligned16(*out)};
    return ffi::Error::Success();
  }

  static ffi::Error Cpu(const Params& p) {
    StartFromInputCpu(p.io);
    for (int g = 0; g < p.groups; ++g) {
      const int first = std::min(std::max(p.ids[g], 0), p.max_m);
      const int64_t row = static_cast<int64_t>(g) * p.max_m + first;
      std::memset(static_cast<char*>(p.io.out) + row * p.row_bytes, 0,
                  static_cast<size_t>(p.max_m - first) * p.row_bytes);
    }
    return ffi::Error::Success();
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    const char* name = "zero_masked_tail";
    if (!p.aligned) return Invalid(name, "d is not 16-byte aligned");
    if (ffi::Error e = StartFromInputCuda(name, p.io, stream); e.failure()) return e;
    // The kernel puts groups on gridDim.y (at most 65535): larger G launches in slices.
    constexpr int kMaxGroups = 65535;
    for (int g = 0; g < p.groups; g += kMaxGroups) {
      const int n = std::min(kMaxGroups, p.groups - g);
      char* d_g = static_cast<char*>(p.io.out) + static_cast<int64_t>(g) * p.max_m * p.row_bytes;
      ffi::Error e = CudaStatus(name, JaxDgZeroMaskedTail(d_g, p.row_bytes, n, p.max_m,
                                                          p.ids + g, stream));
      if (e.failure()) return e;
    }
    return ffi::Error::Success();
  }
#endif

  template <typename B>
  static auto Bind(B b) {
    return std::move(b)
        .template Arg<ffi::AnyBuffer>()             // d [G, Mmax, ...]
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // masked_m [G]
        .template Ret<ffi::AnyBuffer>();            // d again (aliased)
  }
};

struct PaddingRows {
  using Params = Rows;

  static ffi::Error Plan(Params* p, ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> layout,
                         ffi::Result<ffi::AnyBuffer> out, int64_t block, bool skip) {
    const char* name = "zero_padding_rows";
    int64_t row_bytes = 0;
    if (ffi::Error e = RowBytes(name, d, 1, &row_bytes); e.failure()) return e;
    if (!SameLayout(d, *out)) return Invalid(name, "the result must alias d (same type and shape)");
    auto dims = d.dimensions();
    if (!FitsInt(dims[0])) return Invalid(name, "d " + Dims(dims) + " too large");
    if (static_cast<int64_t>(layout.element_count()) < dims[0]) {
      return Invalid(name, "layout has " + std::to_string(layout.element_count()) +
                               " elements, rows = " + std::to_string(dims[0]));
    }
    if (skip && (block < 1 || !FitsInt(block))) {
      return Invalid(name, "block = " + std::to_string(block) + " must be >= 1");
    }
    *p = Rows{InPlaceOf(d, *out), row_bytes, 0, 0, static_cast<int>(dims[0]),
              static_cast<int>(skip ? block : 1), layout.typed_data(), skip, Aligned16(*out)};
    return ffi::Error::Success();
  }

  static ffi::Error Cpu(const Params& p) {
    StartFromInputCpu(p.io);
    for (int r = 0; r < p.rows; ++r) {
      bool zero = p.ids[r] < 0;
      if (zero && p.skip) zero = p.ids[r - r % p.block] >= 0;
      if (zero) {
        std::memset(static_cast<char*>(p.io.out) + static_cast<int64_t>(r) * p.row_bytes, 0,
                    p.row_bytes);
      }
    }
    return ffi::Error::Success();
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    const char* name = "zero_padding_rows";
    if (!p.aligned) return Invalid(name, "d is not 16-byte aligned");
    if (ffi::Error e = StartFromInputCuda(name, p.io, stream); e.failure()) return e;
    return CudaStatus(name, JaxDgZeroPaddingRows(p.io.out, p.row_bytes, p.rows, p.block, p.ids,
                                                 p.skip ? 1 : 0, stream));
  }
#endif

  template <typename B>
  static auto Bind(B b) {
    return std::move(b)
        .template Arg<ffi::AnyBuffer>()             // d [M, ...]
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // layout [M]
        .template Ret<ffi::AnyBuffer>()             // d again (aliased)
        .template Attr<int64_t>("block")
        .template Attr<bool>("skip_padding_blocks");
  }
};

}  // namespace
}  // namespace jax_dg_native

JAX_DG_NATIVE_HANDLERS(MaskedTail, jax_dg_native::MaskedTail);
JAX_DG_NATIVE_HANDLERS(PaddingRows, jax_dg_native::PaddingRows);
