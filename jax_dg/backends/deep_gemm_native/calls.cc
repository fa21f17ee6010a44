// DeepGEMM called from C++: XLA FFI handlers that call the installed DeepGEMM's own C++ entry
// points with ATen views of XLA's buffers, on XLA's stream and device. No Python, no GIL, no
// torch allocation: capturable into XLA's command buffers.
//
// Compiled on first use (jax_dg/backends/deep_gemm_native/__init__.py) against the installed
// DeepGEMM's shipped sources (deep_gemm/csrc, deep_gemm/include, DeepJIT's headers), torch's
// headers and libraries, and jaxlib's XLA FFI headers: the same sources deep_gemm._C is built
// from, so the calls, the kernels and their JIT cache are DeepGEMM's own. DeepGEMM's runtime
// state (deep_gemm::runtime, deep_gemm::jit, deep_gemm::heuristics_runtime: SM count, tc util,
// PDL, the JIT cache, deterministic algorithms) is held in C++17 inline variables, which GCC
// emits as unique global symbols: the dynamic linker binds this library's uses to the instance
// deep_gemm._C created, so both share one runtime (checked at load: SharedRuntime()).
//
// Each handler receives what the trace decided as attributes; it checks nothing DeepGEMM's own
// host code checks again, and the shapes it builds views from are XLA's buffers' own.

#include <atomic>
#include <cstdint>
#include <exception>
#include <utility>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "xla/ffi/api/ffi.h"

// DeepGEMM (this installation's sources)
#include "apis/gemm.hpp"
#include "jit_kernels/impls/sm90_fp8_mqa_logits.hpp"

namespace ffi = xla::ffi;

namespace {

std::atomic<uint64_t> g_calls{0};

at::ScalarType Aten(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return at::kFloat8_e4m3fn;
    case ffi::DataType::BF16: return at::kBFloat16;
    case ffi::DataType::F32: return at::kFloat;
    case ffi::DataType::S32: return at::kInt;
    case ffi::DataType::U8: return at::kByte;
    default: throw std::invalid_argument("jax_dg: an XLA type DeepGEMM's calls do not take");
  }
}

// A contiguous ATen view of an XLA buffer (no copy, nothing owned).
at::Tensor View(const ffi::AnyBuffer& b, int device) {
  auto d = b.dimensions();
  std::vector<int64_t> sizes(d.begin(), d.end());
  return at::from_blob(b.untyped_data(), sizes,
                       at::TensorOptions().dtype(Aten(b.element_type())).device(at::kCUDA, device));
}

// The call on XLA's device and stream (DeepGEMM launches on torch's current stream); DeepGEMM's
// exceptions become FFI errors with its message.
template <typename F>
ffi::Error OnXlaStream(cudaStream_t stream, int32_t device, F&& body) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
    c10::cuda::CUDAStreamGuard stream_guard(
        c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
    body();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("DeepGEMM: ") + e.what());
  }
  return ffi::Error::Success();
}

// fp8_gemm_nt, recipe (1, 128, 128): d[M, N] bf16 = a[M, K] @ b[N, K]^T, a's scales MN-major
// [ceil(K/128), align(M, 4)] (the layout DeepGEMM would otherwise make per call), b's [N/128, K/128].
ffi::Error Fp8GemmNt(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer sfa,
                     ffi::AnyBuffer b, ffi::AnyBuffer sfb, ffi::Result<ffi::AnyBuffer> d,
                     std::string_view compiled_dims) {
  return OnXlaStream(stream, device, [&] {
    const auto ta = View(a, device);
    // sfa arrives [ceil(K/128), align(M, 4)]: DeepGEMM wants the [M, ceil(K/128)] view of it
    const auto tsfa = View(sfa, device).t().narrow(0, 0, ta.size(0));
    deep_gemm::gemm::fp8_fp4_gemm_nt({ta, tsfa}, {View(b, device), View(sfb, device)},
                                     View(*d, device), std::nullopt, std::nullopt, std::nullopt,
                                     std::nullopt, std::string(compiled_dims), false, std::nullopt,
                                     nullptr);
  });
}

// fp8_fp4_mqa_logits on SM90 into XLA's [rows, stride] result: the kernel DeepGEMM's API calls,
// with the buffer it would have allocated given instead (rows, stride and blocks as the API
// computes them, decided at trace time).
ffi::Error Sm90MqaLogits(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                         ffi::AnyBuffer kv_sf, ffi::AnyBuffer weights, ffi::AnyBuffer ks,
                         ffi::AnyBuffer ke, ffi::Result<ffi::AnyBuffer> logits, int64_t block_q,
                         int64_t block_kv) {
  return OnXlaStream(stream, device, [&] {
    auto qd = q.dimensions();
    const int seq_len = static_cast<int>(qd[0]), heads = static_cast<int>(qd[1]);
    const int head_dim = static_cast<int>(qd[2]);
    const int seq_len_kv = static_cast<int>(kv.dimensions()[0]);
    const int stride = static_cast<int>(logits->dimensions()[1]);
    deep_gemm::sm90_fp8_mqa_logits(View(q, device), View(kv, device), View(kv_sf, device),
                                   View(weights, device), View(ks, device), View(ke, device),
                                   View(*logits, device), seq_len, seq_len_kv, stride, heads,
                                   head_dim, static_cast<int>(block_q), static_cast<int>(block_kv));
  });
}

}  // namespace

// XLA's stream and device, then n >= 1 input buffers (what every handler here takes first).
template <int N, typename Binding>
auto Inputs(Binding binding) {
  if constexpr (N == 1) {
    return std::move(binding).template Arg<ffi::AnyBuffer>();
  } else {
    return Inputs<N - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

template <int N>
auto OnXlaStream() {
  return Inputs<N>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>());
}

// Each handler twice: the plain one and its command-buffer-compatible twin (XLA may capture it).
#define JAX_DG_DG_HANDLER(name, fn, binding)              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn, binding);       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Graph, fn, binding, \
                                {xla::ffi::Traits::kCmdBufferCompatible})

JAX_DG_DG_HANDLER(JaxDgDeepGemmFp8GemmNt, Fp8GemmNt,
                  OnXlaStream<4>().Ret<ffi::AnyBuffer>().Attr<std::string_view>("compiled_dims"));

JAX_DG_DG_HANDLER(JaxDgDeepGemmSm90MqaLogits, Sm90MqaLogits,
                  OnXlaStream<6>().Ret<ffi::AnyBuffer>().Attr<int64_t>("block_q").Attr<int64_t>("block_kv"));

extern "C" {

// Handler entries (a replayed command buffer adds none).
uint64_t JaxDgDeepGemmCalls() { return g_calls.load(std::memory_order_relaxed); }

// The address of the DeepGEMM runtime this library uses: equal to deep_gemm._C's when the two
// share one runtime (the loader compares it with the symbol _C exports).
const void* JaxDgDeepGemmRuntime() { return &deep_gemm::runtime; }

}  // extern "C"
