// The checked mode's index-value check (jax_dg.core.values, `jax_dg.checked()`) as a typed XLA
// FFI handler: inside jit a failed check is the XLA error of this call, whose text is jax_dg's
// message alone. (A Python host callback's error starts with JAX's "CpuCallback error" line and
// a traceback of the caller's frames, which buries the message.)
//
// ok uint8 [n] (1: the entry keeps the rule), values int32 [n] (or [0]: report positions) and
// carry (any array), aliased to the one result: the checked value passes through untouched, so
// that what reads it next is ordered after the check. Registered in ffi/native.cc's table. Attributes: message ("op: `arg` rule"),
// rows (report "rows [..] holding [..]"). CUDA: the two vectors are copied to the host on XLA's stream, which is synchronised
// (a debugging mode: one round trip per check, as with a host callback).

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef JAX_DG_CUDA
#include <cuda_runtime.h>
#endif

namespace ffi = xla::ffi;

namespace {

std::string List(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The same text as values._fail (the eager form), so that both read alike.
ffi::Error Verdict(const uint8_t* ok, const int32_t* values, int64_t n, int64_t n_values,
                   std::string_view message, bool rows) {
  std::vector<int64_t> where;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (ok[i]) continue;
    if (where.size() < 4) where.push_back(i);
    ++bad;
  }
  if (bad == 0) return ffi::Error::Success();
  std::vector<int64_t> got = where;
  if (n_values == n) {
    for (auto& w : got) w = values[w];
  }
  std::string text(message);
  text += ", got ";
  text += rows ? "rows " + List(where) + " holding " + List(got) : List(got);
  text += " (" + std::to_string(bad) + " of " + std::to_string(n) +
          (rows ? " rows break it)" : " entries out of range)");
  return ffi::Error::InvalidArgument(text);
}

ffi::Error CheckCpu(ffi::Buffer<ffi::U8> ok, ffi::Buffer<ffi::S32> values, ffi::AnyBuffer,
                    ffi::Result<ffi::AnyBuffer>, std::string_view message, bool rows) {
  return Verdict(ok.typed_data(), values.typed_data(), static_cast<int64_t>(ok.element_count()),
                 static_cast<int64_t>(values.element_count()), message, rows);
}

#ifdef JAX_DG_CUDA
ffi::Error CheckCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> ok, ffi::Buffer<ffi::S32> values,
                     ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, std::string_view message,
                     bool rows) {
  const size_t n = ok.element_count(), n_values = values.element_count();
  std::vector<uint8_t> host_ok(n);
  std::vector<int32_t> host_values(n_values);
  cudaError_t err = cudaSuccess;
  if (n) err = cudaMemcpyAsync(host_ok.data(), ok.typed_data(), n, cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess && n_values) {
    err = cudaMemcpyAsync(host_values.data(), values.typed_data(), n_values * sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_dg checked mode: CUDA error ") +
                                cudaGetErrorString(err));
  }
  return Verdict(host_ok.data(), host_values.data(), static_cast<int64_t>(n),
                 static_cast<int64_t>(n_values), message, rows);
}
#endif

}  // namespace

namespace {

// The arguments and attributes both platforms bind (after the CUDA stream, where there is one).
template <typename Binding>
auto CheckBinding(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::U8>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<std::string_view>("message")
      .template Attr<bool>("rows");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeCheckCpu, CheckCpu, CheckBinding(ffi::Ffi::Bind()));

#ifdef JAX_DG_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeCheckCuda, CheckCuda,
                              CheckBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
#endif
