// jax_dg's one XLA FFI handler: every op's custom call lands here, on "cpu" and on "CUDA".
//
// It knows no op. It hands XLA's buffers to Python as torch tensors made through DLPack
// (views of XLA's memory, never copies), together with XLA's stream and device, and calls the
// Python callable that jax_dg prepared for this call site. A Python exception becomes an FFI
// error carrying its message, so the JAX program sees an error and the process lives on.
//
// Ops whose call is capture-safe also get a second target whose CUDA handler is declared
// command-buffer compatible (see JaxDgCudaGraphCall).
//
// It also exports the two functions of a torch pluggable allocator ("landing"): torch asks them
// for the memory of the one allocation a DeepGEMM call makes (its logits), and they hand back
// the XLA result buffer armed for that call, so the kernel writes straight into XLA's memory.
//
// Two caches keep the hot path to a few dictionary lookups:
//   sites: the `site` attribute string (op name + static attributes) -> prepared callable;
//   views: (pointer, dtype, shape, device) -> torch tensor viewing that memory.
// Both are touched only with the GIL held.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>

#include <pthread.h>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

enum class Platform : int { kCpu = 0, kCuda = 1 };

// Python hooks, set once by jax_dg.runtime.bridge (imported by the first call). Heap objects that are never freed: their
// destructors must not run after the interpreter is gone.
nb::object* g_prepare = nullptr;  // prepare(site: str, platform: str) -> callable
nb::object* g_retype = nullptr;   // retype(tensor, xla_dtype: int) -> tensor (fp8 views)
auto* g_sites = new std::unordered_map<std::string, nb::object>();
auto* g_views = new std::unordered_map<std::string, nb::object>();
constexpr size_t kMaxViews = 4096;  // XLA reuses addresses; bound the cache all the same
// Handler entries, for tests that prove a replayed CUDA graph calls no Python.
std::atomic<uint64_t> g_calls{0};

// The probe (benchmarks/bench_dispatch.py): when on, each handler entry records when it
// entered, got the GIL, had its site and views, returned from Python and left, in
// CLOCK_MONOTONIC nanoseconds (Python's time.monotonic_ns), with its thread. Off: one relaxed
// load per call.
std::atomic<bool> g_probe{false};
std::mutex g_probe_mutex;
auto* g_probe_events = new std::vector<std::array<uint64_t, 6>>();

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// DLPack type of an XLA element type. FP8 travels as uint8 and is re-typed in Python
// (`retype`): DLPack's FP8 codes are newer than some torch builds we must load.
bool DlpackType(ffi::DataType t, nb::dlpack::dtype* out, bool* needs_retype) {
  using C = nb::dlpack::dtype_code;
  auto set = [&](C code, int bits) {
    *out = nb::dlpack::dtype{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
    return true;
  };
  *needs_retype = false;
  switch (t) {
    case ffi::DataType::PRED: return set(C::Bool, 8);
    case ffi::DataType::S8: return set(C::Int, 8);
    case ffi::DataType::S16: return set(C::Int, 16);
    case ffi::DataType::S32: return set(C::Int, 32);
    case ffi::DataType::S64: return set(C::Int, 64);
    case ffi::DataType::U8: return set(C::UInt, 8);
    case ffi::DataType::U16: return set(C::UInt, 16);
    case ffi::DataType::U32: return set(C::UInt, 32);
    case ffi::DataType::U64: return set(C::UInt, 64);
    case ffi::DataType::F16: return set(C::Float, 16);
    case ffi::DataType::F32: return set(C::Float, 32);
    case ffi::DataType::F64: return set(C::Float, 64);
    case ffi::DataType::BF16: return set(C::Bfloat, 16);
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2:
      *needs_retype = true;
      return set(C::UInt, 8);
    default: return false;
  }
}

// A torch tensor viewing `buf`, from the cache when XLA hands us the same memory again.
nb::object View(const ffi::AnyBuffer& buf, Platform platform, int32_t device) {
  ffi::DataType dtype = buf.element_type();
  auto dims = buf.dimensions();
  void* data = buf.untyped_data();

  std::string key;
  key.reserve(32 + 8 * dims.size());
  auto put = [&key](const void* p, size_t n) { key.append(static_cast<const char*>(p), n); };
  put(&data, sizeof(data));
  int32_t head[3] = {static_cast<int32_t>(dtype), static_cast<int32_t>(platform), device};
  put(head, sizeof(head));
  for (int64_t d : dims) put(&d, sizeof(d));

  auto it = g_views->find(key);
  if (it != g_views->end()) return it->second;

  nb::dlpack::dtype dl;
  bool retype = false;
  if (!DlpackType(dtype, &dl, &retype)) {
    throw nb::type_error(("jax_dg bridge: unsupported XLA element type " +
                          std::to_string(static_cast<int>(dtype))).c_str());
  }
  size_t shape[16];
  if (dims.size() > 16) throw nb::value_error("jax_dg bridge: rank above 16");
  for (size_t i = 0; i < dims.size(); ++i) shape[i] = static_cast<size_t>(dims[i]);
  int dev_type = platform == Platform::kCuda ? nb::device::cuda::value : nb::device::cpu::value;
  // No owner: XLA owns the memory and keeps it alive for the duration of the call.
  nb::ndarray<nb::pytorch> arr(data, dims.size(), shape, nb::handle(), nullptr, dl, dev_type,
                               platform == Platform::kCuda ? device : 0);
  // `reference`: without an owner nanobind would otherwise copy the data.
  nb::object tensor = arr.cast(nb::rv_policy::reference);
  if (retype) tensor = (*g_retype)(tensor, static_cast<int>(dtype));

  if (g_views->size() >= kMaxViews) g_views->clear();
  g_views->emplace(std::move(key), tensor);
  return tensor;
}

const nb::object& Site(std::string_view site, Platform platform) {
  std::string key(site);
  key.push_back(platform == Platform::kCuda ? 'G' : 'C');
  auto it = g_sites->find(key);
  if (it != g_sites->end()) return it->second;
  nb::object fn = (*g_prepare)(nb::str(site.data(), site.size()),
                               platform == Platform::kCuda ? "cuda" : "cpu");
  return g_sites->emplace(std::move(key), std::move(fn)).first->second;
}

// XLA runs custom calls on its own threads. PyGILState_Ensure on a thread without a Python
// thread state creates one and the matching Release destroys it again: about 15 us per call.
// Take one Ensure per thread that is never released, so the state lives as long as the thread
// and every later acquire only takes the GIL.
void KeepPythonThreadState() {
  thread_local bool kept = false;
  if (kept) return;
  kept = true;
  if (PyGILState_Check()) return;  // a Python thread that holds the GIL has its state already
  PyGILState_Ensure();
  PyEval_SaveThread();
}

ffi::Error Call(Platform platform, void* stream, int32_t device, std::string_view site,
                ffi::RemainingArgs args, ffi::RemainingRets rets) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const bool probe = g_probe.load(std::memory_order_relaxed);
  std::array<uint64_t, 6> t{};
  if (probe) t[0] = static_cast<uint64_t>(pthread_self()), t[1] = NowNs();
  KeepPythonThreadState();
  nb::gil_scoped_acquire gil;
  if (probe) t[2] = NowNs();
  try {
    // The Python half installs its hooks when imported; nothing but this call imports it, so
    // a process that runs no DeepGEMM op never imports it (nor torch).
    if (g_prepare == nullptr) nb::module_::import_("jax_dg.runtime.bridge");
    if (g_prepare == nullptr) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jax_dg bridge: jax_dg.runtime.bridge installed no hooks");
    }
    const nb::object& fn = Site(site, platform);
    nb::tuple ins = nb::steal<nb::tuple>(PyTuple_New(static_cast<Py_ssize_t>(args.size())));
    nb::tuple outs = nb::steal<nb::tuple>(PyTuple_New(static_cast<Py_ssize_t>(rets.size())));
    for (size_t i = 0; i < args.size(); ++i) {
      auto buf = args.get<ffi::AnyBuffer>(i);
      if (!buf.has_value()) return buf.error();
      PyTuple_SET_ITEM(ins.ptr(), i, View(*buf, platform, device).release().ptr());
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      auto buf = rets.get<ffi::AnyBuffer>(i);
      if (!buf.has_value()) return buf.error();
      PyTuple_SET_ITEM(outs.ptr(), i, View(**buf, platform, device).release().ptr());
    }
    if (probe) t[3] = NowNs();
    fn(reinterpret_cast<uintptr_t>(stream), device, ins, outs);
    if (probe) t[4] = NowNs();
  } catch (nb::python_error& e) {
    // Type and message only: the closure names the op; Python's traceback (the caller's frames
    // down to XLA's dispatch) would bury that text in the JAX error.
    std::string text;
    try {
      text = std::string(nb::str(e.type().attr("__name__")).c_str()) + ": " +
             nb::str(e.value()).c_str();
    } catch (std::exception&) {   // a __str__ that raises: never let it escape the handler
      text = "jax_dg bridge: the call raised an exception whose message could not be read";
    }
    return ffi::Error(ffi::ErrorCode::kInternal, text);
  } catch (std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
  if (probe) {
    t[5] = NowNs();
    std::lock_guard<std::mutex> lock(g_probe_mutex);
    g_probe_events->push_back(t);
  }
  return ffi::Error::Success();
}

ffi::Error CpuCall(std::string_view site, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Call(Platform::kCpu, nullptr, 0, site, args, rets);
}

ffi::Error CudaCall(void* stream, int32_t device, std::string_view site, ffi::RemainingArgs args,
                    ffi::RemainingRets rets) {
  return Call(Platform::kCuda, stream, device, site, args, rets);
}

// --- landing: a torch allocation placed in an XLA buffer ----------------------------------------
//
// jax_dg.runtime.landing arms a slot with an XLA result buffer, routes the current thread's torch
// allocations to a fresh MemPool backed by these two functions, and makes the DeepGEMM call.
// The slot is per thread (torch allocates on the calling thread) and serves one request: a
// second request, or one larger than the buffer, gets nullptr (torch then fails the
// allocation, and landing falls back to DeepGEMM's own allocation plus a copy). Freeing never
// releases anything: the memory is XLA's.
struct Slot {
  void* ptr = nullptr;
  size_t capacity = 0;
  int device = -1;
  bool armed = false;
  size_t last_request = 0;  // what torch asked for last (its segment rounding, for tests)
  uint64_t refused = 0;      // requests this thread's allocator refused (landing's fallback cue)
};
thread_local Slot t_slot;
std::atomic<uint64_t> g_landed{0}, g_refused{0}, g_released{0};
// Landed requests per device: torch's allocation counts are per device, and the capture guard
// (jax_dg.runtime.guards.allocations) subtracts this device's landings from them only (another
// device's shard may land at the same time on its own thread).
constexpr int kMaxDevices = 256;
std::array<std::atomic<uint64_t>, kMaxDevices> g_landed_on{};

extern "C" void* JaxDgLandingAlloc(size_t size, int device, void* /*stream*/) {
  Slot& s = t_slot;
  s.last_request = size;
  if (!s.armed || device != s.device || size > s.capacity) {
    ++s.refused;
    g_refused.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  s.armed = false;
  g_landed.fetch_add(1, std::memory_order_relaxed);
  if (device >= 0 && device < kMaxDevices) g_landed_on[device].fetch_add(1, std::memory_order_relaxed);
  return s.ptr;
}

extern "C" void JaxDgLandingFree(void* /*ptr*/, size_t /*size*/, int /*device*/, void* /*stream*/) {
  g_released.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgCpuCall, CpuCall,
                              ffi::Ffi::Bind()
                                  .Attr<std::string_view>("site")
                                  .RemainingArgs()
                                  .RemainingRets());

// XLA's stream and device ordinal, the call site, every buffer.
auto CudaBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attr<std::string_view>("site")
      .RemainingArgs()
      .RemainingRets();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgCudaCall, CudaCall, CudaBinding());

// The same handler declared command-buffer compatible: XLA may run it under stream capture and
// replay the recorded work without calling it again. Only ops whose call allocates nothing on
// torch's side and launches the same work every time use it (Op.graph_safe); the CUDA plugin
// takes no traits at registration, so it is a symbol (and target) of its own.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgCudaGraphCall, CudaCall, CudaBinding(),
                              {ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_bridge, m) {
  m.doc() = "jax_dg's generic XLA FFI handler (see ffi/bridge.cc)";
  m.def("handlers", []() {
    nb::dict d;
    d["cpu"] = nb::capsule(reinterpret_cast<void*>(JaxDgCpuCall));
    d["CUDA"] = nb::capsule(reinterpret_cast<void*>(JaxDgCudaCall));
    return d;
  });
  m.def("graph_handlers", []() {
    nb::dict d;
    d["cpu"] = nb::capsule(reinterpret_cast<void*>(JaxDgCpuCall));  // no command buffers on CPU
    d["CUDA"] = nb::capsule(reinterpret_cast<void*>(JaxDgCudaGraphCall));
    return d;
  });
  m.def("landing_functions", []() {
    return nb::make_tuple(reinterpret_cast<uintptr_t>(&JaxDgLandingAlloc),
                          reinterpret_cast<uintptr_t>(&JaxDgLandingFree));
  });
  m.def("landing_arm", [](uintptr_t ptr, size_t capacity, int device) {
    t_slot.ptr = reinterpret_cast<void*>(ptr);
    t_slot.capacity = capacity;
    t_slot.device = device;
    t_slot.armed = true;
  });
  // Disarms this thread's slot; True if it was still armed (nothing landed).
  m.def("landing_disarm", []() {
    bool was = t_slot.armed;
    t_slot.armed = false;
    t_slot.ptr = nullptr;
    return was;
  });
  m.def("landing_last_request", []() { return t_slot.last_request; });
  m.def("landing_refused", []() { return t_slot.refused; });   // this thread's, all time
  m.def("landing_counts", []() {
    return nb::make_tuple(g_landed.load(), g_refused.load(), g_released.load());
  });
  m.def("landing_landed_on", [](int device) -> uint64_t {   // landed requests on one device
    return device >= 0 && device < kMaxDevices ? g_landed_on[device].load() : 0;
  });
  m.def("call_count", []() { return g_calls.load(std::memory_order_relaxed); });
  // The probe: on/off (clears what was recorded), and the events recorded since.
  m.def("probe", [](bool on) {
    std::lock_guard<std::mutex> lock(g_probe_mutex);
    g_probe_events->clear();
    g_probe.store(on);
  });
  m.def("probe_events", []() {
    std::lock_guard<std::mutex> lock(g_probe_mutex);
    nb::list out;
    for (const auto& e : *g_probe_events) {
      out.append(nb::make_tuple(e[0], e[1], e[2], e[3], e[4], e[5]));
    }
    return out;
  });
  m.def("install", [](nb::object prepare, nb::object retype) {
    delete g_prepare;
    delete g_retype;
    g_prepare = new nb::object(std::move(prepare));
    g_retype = new nb::object(std::move(retype));
    g_sites->clear();
    g_views->clear();
  });
  m.def("clear_caches", []() {
    g_sites->clear();
    g_views->clear();
  });
  m.def("cache_sizes", []() { return nb::make_tuple(g_sites->size(), g_views->size()); });
}
