// jax_dg's own kernels (kernels/*.cu) as typed XLA FFI handlers: no Python, no GIL, no torch.
// This file is their one registration table and the `_native` module; each kernel's handlers
// are in ffi/<kernel>.cc, made from one contract by ffi/handlers.h:
//   CUDA: launches the kernel's extern "C" launcher on XLA's stream. Declared command-buffer
//         compatible (the launches allocate nothing and are the same on every call), so XLA may
//         capture them into a CUDA graph and replay them without calling the handler again.
//   cpu:  a plain C++ implementation with bitwise the same results (what the CPU suite runs).
// Both check the buffers and attributes first, the same way, so a program that fails on one
// platform fails on the other with the same message; the CUDA kernels' own limits (16-byte rows,
// k <= 4096) are part of that shared contract.
//
// Optional int32 inputs (lo, hi, valid_rows, a schedule) arrive as zero-size arrays with a
// `has_*` attribute: the custom call keeps a fixed signature and no fill kernel is added for an
// absent one. In-place kernels (neg_inf_outside, zero_*) are called with input 0 aliased to
// output 0: they write only some positions of the result buffer and leave the rest as the input
// had them.

#include <cstdint>

#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"
#include "handlers.h"

namespace nb = nanobind;

// The table: custom-call target -> the handler pair JaxDgNative<Name>{Cpu,Cuda} defined by
// JAX_DG_NATIVE_HANDLERS(Name, ...) in ffi/<kernel>.cc. jax_dg.core.registry registers them.
#define JAX_DG_NATIVE_KERNELS(X)                      \
  X("jax_dg_native_topk", Topk)                       \
  X("jax_dg_native_neg_inf_outside", NegInf)          \
  X("jax_dg_native_zero_masked_tail", MaskedTail)     \
  X("jax_dg_native_zero_padding_rows", PaddingRows)   \
  X("jax_dg_native_paged_sanitise", Sanitise)         \
  X("jax_dg_native_cast_fp8", CastFp8)                \
  X("jax_dg_check", Check)

#ifdef JAX_DG_CUDA
#define JAX_DG_DECLARE(target, Name)                    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDgNative##Name##Cpu); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDgNative##Name##Cuda);
#define JAX_DG_CUDA_HANDLER(Name) JaxDgNative##Name##Cuda
constexpr bool kCudaBuilt = true;
#else
#define JAX_DG_DECLARE(target, Name) XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDgNative##Name##Cpu);
#define JAX_DG_CUDA_HANDLER(Name) nullptr
constexpr bool kCudaBuilt = false;
#endif
JAX_DG_NATIVE_KERNELS(JAX_DG_DECLARE)

namespace jax_dg_native {   // ffi/topk.cc
int TopkMaxK();
int64_t TopkScratchBytes(int64_t cols, int64_t k, bool sorted);
}  // namespace jax_dg_native

namespace {

nb::dict Platforms(XLA_FFI_Handler* cpu, XLA_FFI_Handler* cuda) {
  nb::dict d;
  d["cpu"] = nb::capsule(reinterpret_cast<void*>(cpu));
  if (cuda != nullptr) d["CUDA"] = nb::capsule(reinterpret_cast<void*>(cuda));
  return d;
}

// target name -> {platform: handler capsule}
nb::dict Handlers() {
  nb::dict d;
#define JAX_DG_REGISTER(target, Name) \
  d[target] = Platforms(JaxDgNative##Name##Cpu, JAX_DG_CUDA_HANDLER(Name));
  JAX_DG_NATIVE_KERNELS(JAX_DG_REGISTER)
#undef JAX_DG_REGISTER
  return d;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax_dg's own kernels as native XLA FFI handlers (see ffi/native.cc)";
  m.def("handlers", &Handlers);
  m.def("cuda_built", []() { return kCudaBuilt; });
  m.def("max_k", &jax_dg_native::TopkMaxK);
  m.def("topk_scratch_bytes", &jax_dg_native::TopkScratchBytes,
        "Scratch bytes a row the top-k's CUDA kernel splits rows of `cols` keys with (0: never split).");
  m.def("call_count", []() { return jax_dg_native::g_calls.load(std::memory_order_relaxed); });
}
