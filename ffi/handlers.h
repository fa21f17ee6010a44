// What every native handler shares (ffi/native.cc, ffi/cast_fp8.cc): the entry counter, the
// error messages, the guard around CPU bodies and the CUDA status checks.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
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

#ifdef JAX_DG_CUDA
inline ffi::Error CudaStatus(const char* kernel, int err) {
  if (err == 0) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dg native ") + kernel + ": CUDA error " +
                              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The launchers report cudaGetLastError() after their launch: clear an error left on this
// thread by someone else's earlier launch so that it is not reported as ours.
inline void ClearStaleError() { (void)cudaGetLastError(); }

// The kernels store 16 bytes at a time (an empty buffer may have any address).
inline bool Aligned16(const ffi::AnyBuffer& d) {
  return d.size_bytes() == 0 || reinterpret_cast<uintptr_t>(d.untyped_data()) % 16 == 0;
}

#endif  // JAX_DG_CUDA

}  // namespace jax_dg_native
