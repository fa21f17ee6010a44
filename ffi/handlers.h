// What every native handler shares (ffi/<kernel>.cc): the entry counter, the error messages, the
// guard around CPU bodies, the CUDA status checks, and the one template that makes a kernel's
// two handlers.
//
// A kernel is a struct K of one contract on both platforms:
//   struct Params;                              what both bodies need, from the checks
//   static ffi::Error Plan(Params*, args...);   checks the buffers and attributes (the handler's
//                                               arguments, in its binding's order), the same way
//                                               on both platforms, so a program that fails on one
//                                               fails on the other with the same message
//   static ffi::Error Cpu(const Params&);       the C++ twin, bitwise the CUDA kernel's results
//   static ffi::Error Cuda(cudaStream_t, const Params&);   the launch on XLA's stream: host work
//                                               only before it (no device reads, no allocation,
//                                               no synchronization), so it may be captured
//   template <typename B> static auto Bind(B);  the binding: arguments, results, attributes
// JAX_DG_NATIVE_HANDLERS(Name, K) defines its handler symbols JaxDgNative<Name>Cpu and, where
// CUDA is built, JaxDgNative<Name>Cuda (command-buffer compatible: XLA may capture and replay
// it); ffi/native.cc's table registers them under the kernel's target name.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "xla/ffi/api/ffi.h"

#ifdef JAX_DG_CUDA
#include <cuda_runtime.h>
#endif

namespace jax_dg_native {

namespace ffi = xla::ffi;

// Handler entries on every platform: a replayed CUDA graph adds none (tests rely on it).
inline std::atomic<uint64_t> g_calls{0};

inline void Count() { g_calls.fetch_add(1, std::memory_order_relaxed); }

inline ffi::Error Invalid(const char* kernel, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jax_dg native ") + kernel + ": " + what);
}

inline bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

inline std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Runs a CPU body; an exception (bad_alloc) becomes an FFI error, never an abort.
template <typename F>
ffi::Error Guarded(const char* kernel, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_dg native ") + kernel + ": " + e.what());
  }
  return ffi::Error::Success();
}

// The CUDA kernels store 16 bytes at a time (an empty buffer may have any address).
inline bool Aligned16(const ffi::AnyBuffer& d) {
  return d.size_bytes() == 0 || reinterpret_cast<uintptr_t>(d.untyped_data()) % 16 == 0;
}

// Same element type and shape: the aliased result of an in-place kernel.
inline bool SameLayout(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  return a.element_type() == b.element_type() && da.size() == db.size() &&
         std::equal(da.begin(), da.end(), db.begin());
}

// An in-place kernel's input and result (aliased): if XLA ever hands two buffers, the result
// starts as a copy of the input.
struct InPlace {
  const void* in;
  void* out;
  size_t bytes;
};

inline InPlace InPlaceOf(const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  return InPlace{in.untyped_data(), out.untyped_data(), in.size_bytes()};
}

inline void StartFromInputCpu(const InPlace& io) {
  if (io.out != io.in && io.bytes > 0) std::memcpy(io.out, io.in, io.bytes);
}

#ifdef JAX_DG_CUDA
inline ffi::Error CudaStatus(const char* kernel, int err) {
  if (err == 0) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dg native ") + kernel + ": CUDA error " +
                              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The launchers report cudaGetLastError() after their launch: clear an error left on this
// thread by someone else's earlier launch so that it is not reported as ours.
inline void ClearStaleError() { (void)cudaGetLastError(); }

// The in-place copy on the stream (a device copy: capture-safe).
inline ffi::Error StartFromInputCuda(const char* kernel, const InPlace& io, cudaStream_t stream) {
  if (io.out == io.in || io.bytes == 0) return ffi::Error::Success();
  return CudaStatus(kernel, cudaMemcpyAsync(io.out, io.in, io.bytes, cudaMemcpyDeviceToDevice,
                                            stream));
}
#endif  // JAX_DG_CUDA

// A kernel's two handlers, from its Plan's signature: count the entry, check, run.
template <typename K, typename Sig = decltype(&K::Plan)>
struct Handlers;

template <typename K, typename P, typename... Args>
struct Handlers<K, ffi::Error (*)(P*, Args...)> {
  static ffi::Error Cpu(Args... args) {
    Count();
    P p;
    if (ffi::Error e = K::Plan(&p, args...); e.failure()) return e;
    return K::Cpu(p);
  }
#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, Args... args) {
    Count();
    P p;
    if (ffi::Error e = K::Plan(&p, args...); e.failure()) return e;
    ClearStaleError();
    return K::Cuda(stream, p);
  }
#endif
};

}  // namespace jax_dg_native

// Defines a kernel's handler symbols (see the top of this file). The CUDA binding adds XLA's
// stream in front; the CUDA plugin refuses traits at registration, so they are the symbol's own.
#define JAX_DG_NATIVE_CPU_HANDLER(Name, K)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNative##Name##Cpu,                            \
                                ::jax_dg_native::Handlers<K>::Cpu,                 \
                                K::Bind(::xla::ffi::Ffi::Bind()))
#ifdef JAX_DG_CUDA
#define JAX_DG_NATIVE_HANDLERS(Name, K)                                            \
  JAX_DG_NATIVE_CPU_HANDLER(Name, K);                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                   \
      JaxDgNative##Name##Cuda, ::jax_dg_native::Handlers<K>::Cuda,                 \
      K::Bind(::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()), \
      {::xla::ffi::Traits::kCmdBufferCompatible})
#else
#define JAX_DG_NATIVE_HANDLERS(Name, K) JAX_DG_NATIVE_CPU_HANDLER(Name, K)
#endif
