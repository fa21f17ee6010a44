// Python binding of jax_dg's own CUDA kernels (kernels/*.cu). Built only where CMake finds a
// CUDA toolkit; without it jax_dg runs the torch reference of the same kernels.

#include <cstdint>
#include <string>

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

namespace nb = nanobind;

extern "C" int JaxDgTopkMaxK();
extern "C" int JaxDgTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, cudaStream_t stream);
extern "C" int JaxDgNegInfOutside(void* logits, int64_t stride, int elem_bytes, int rows, int cols,
                                  const int* lo, const int* hi, int relative, cudaStream_t stream);
extern "C" int JaxDgZeroMaskedTail(void* d, int64_t row_bytes, int groups, int max_m,
                                   const int* masked_m, cudaStream_t stream);
extern "C" int JaxDgZeroPaddingRows(void* d, int64_t row_bytes, int rows, int block,
                                    const int* layout, int skip_padding_blocks, cudaStream_t stream);

namespace {

void Check(int err, const char* what) {
  if (err != 0) {
    throw nb::value_error((std::string("jax_dg ") + what + ": CUDA error " +
                           cudaGetErrorString(static_cast<cudaError_t>(err))).c_str());
  }
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "jax_dg's own CUDA kernels (see kernels/)";
  m.def("topk_max_k", &JaxDgTopkMaxK);
  // Pointers as integers (torch's data_ptr(), the raw stream): the caller owns the memory.
  m.def("topk_rows", [](uintptr_t logits, int64_t stride, uintptr_t lo, uintptr_t hi, int rows,
                        int cols, int k, bool sorted, uintptr_t out, uintptr_t stream) {
    Check(JaxDgTopkRows(reinterpret_cast<const float*>(logits), stride,
                        reinterpret_cast<const int*>(lo), reinterpret_cast<const int*>(hi), rows,
                        cols, k, sorted ? 1 : 0, reinterpret_cast<int*>(out),
                        reinterpret_cast<cudaStream_t>(stream)),
          "topk_rows");
  });
  m.def("neg_inf_outside", [](uintptr_t logits, int64_t stride, int elem_bytes, int rows, int cols,
                              uintptr_t lo, uintptr_t hi, bool relative, uintptr_t stream) {
    Check(JaxDgNegInfOutside(reinterpret_cast<void*>(logits), stride, elem_bytes, rows, cols,
                             reinterpret_cast<const int*>(lo), reinterpret_cast<const int*>(hi),
                             relative ? 1 : 0, reinterpret_cast<cudaStream_t>(stream)),
          "neg_inf_outside");
  });
  m.def("zero_masked_tail", [](uintptr_t d, int64_t row_bytes, int groups, int max_m,
                               uintptr_t masked_m, uintptr_t stream) {
    Check(JaxDgZeroMaskedTail(reinterpret_cast<void*>(d), row_bytes, groups, max_m,
                              reinterpret_cast<const int*>(masked_m),
                              reinterpret_cast<cudaStream_t>(stream)),
          "zero_masked_tail");
  });
  m.def("zero_padding_rows", [](uintptr_t d, int64_t row_bytes, int rows, int block,
                                uintptr_t layout, bool skip_padding_blocks, uintptr_t stream) {
    Check(JaxDgZeroPaddingRows(reinterpret_cast<void*>(d), row_bytes, rows, block,
                               reinterpret_cast<const int*>(layout), skip_padding_blocks ? 1 : 0,
                               reinterpret_cast<cudaStream_t>(stream)),
          "zero_padding_rows");
  });
}
