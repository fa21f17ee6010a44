// jax_dg's own kernels (kernels/*.cu) as typed XLA FFI handlers: no Python, no GIL, no torch.
//
// Every kernel has two handlers of one contract:
//   CUDA: launches the kernel's extern "C" launcher on XLA's stream. Declared command-buffer
//         compatible (the launches allocate nothing and are the same on every call), so XLA may
//         capture them into a CUDA graph and replay them without calling the handler again.
//   cpu:  a plain C++ implementation with bitwise the same results (what the CPU suite runs).
// Both check the buffers and attributes first, the same way, so a program that fails on one
// platform fails on the other with the same message; the CUDA kernels' own limits (16-byte rows,
// k <= 4096) are part of that shared contract.
//
// Optional int32 inputs (lo, hi) arrive as zero-size arrays with a `has_*` attribute: the
// custom call keeps a fixed signature and no fill kernel is added for an absent one.
//
// The fused FP8 casts are ffi/cast_fp8.cc; what every handler shares is ffi/handlers.h.
//
// In-place kernels (neg_inf_outside, zero_*) are called with input 0 aliased to output 0: they
// write only some positions of the result buffer and leave the rest as the input had them.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"
#include "handlers.h"
#include "../kernels/topk_split.h"

#ifdef JAX_DG_CUDA
#include <cuda_runtime.h>

extern "C" int JaxDgTopkMaxK();
extern "C" int JaxDgTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, void* scratch,
                             int64_t scratch_bytes, cudaStream_t stream);
extern "C" int JaxDgNegInfOutside(void* logits, int64_t stride, int elem_bytes, int rows, int cols,
                                  const int* lo, const int* hi, int relative, cudaStream_t stream);
extern "C" int JaxDgZeroMaskedTail(void* d, int64_t row_bytes, int groups, int max_m,
                                   const int* masked_m, cudaStream_t stream);
extern "C" int JaxDgZeroPaddingRows(void* d, int64_t row_bytes, int rows, int block,
                                    const int* layout, int skip_padding_blocks,
                                    cudaStream_t stream);
extern "C" int JaxDgPagedSanitise(const int* lens, int one_d, int next_n, const int* table, int rows,
                                  int width, int out_width, int64_t num_blocks, int block_size,
                                  int limit, int zero_unused, const int* meta, int entries,
                                  int* ctx, int* table_out, int* meta_out, cudaStream_t stream);
#endif

namespace nb = nanobind;
namespace ffi = xla::ffi;
using namespace jax_dg_native;   // NOLINT: the shared helpers

namespace {

constexpr int kMaxK = 4096;   // kernels/topk.cu's limit (JaxDgTopkMaxK), the CPU's too

// Element types stored one or more whole bytes per element (the zero kernels write bytes).
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

// Same element type and shape: the aliased result of an in-place kernel.
bool SameLayout(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  return a.element_type() == b.element_type() && da.size() == db.size() &&
         std::equal(da.begin(), da.end(), db.begin());
}

// An in-place kernel's result is its input (aliased); if XLA ever hands two buffers, the
// result starts as a copy of the input.
void StartFromInputCpu(const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (out.untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out.untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

// ================================ topk ========================================================
// out[r] (int32 [rows, k]) = the columns of row r's k largest logits among lo[r] <= c <
// min(hi[r], cols) with logits > -inf (NaN never), value descending then column ascending
// (+0.0 above -0.0), or (unsorted) the same set in column order; -1 past the candidates.
// logits float32 [R, S]: rows <= R, cols <= S (S is the row stride). scratch: uint8 [rows,
// jax_dg_topk::ScratchBytes(1, cols, k, sorted)] (kernels/topk_split.h; [rows, 0] where rows are
// never split), for the CUDA kernel's long rows; the CPU does not touch it.

struct Topk {
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

ffi::Error PlanTopk(ffi::Buffer<ffi::F32, 2> logits, ffi::Buffer<ffi::S32, 1> lo,
                    ffi::Buffer<ffi::S32, 1> hi, ffi::Buffer<ffi::S32, 2>& out,
                    ffi::Buffer<ffi::U8, 2>& scratch, int64_t cols, bool sorted, bool has_lo,
                    bool has_hi, Topk* p) {
  const char* name = "topk";
  auto ld = logits.dimensions(), od = out.dimensions();
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
  auto sd = scratch.dimensions();
  const int64_t scratch_row = jax_dg_topk::ScratchBytes(1, cols, k, sorted);
  if (sd[0] != rows || sd[1] != scratch_row) {   // the shape rule (jax_dg.core.native.topk)
    return Invalid(name, "scratch " + Dims(sd) + ", expected [" + std::to_string(rows) + ", " +
                             std::to_string(scratch_row) + "]");
  }
  *p = Topk{logits.typed_data(), ld[1], has_lo ? lo.typed_data() : nullptr,
            has_hi ? hi.typed_data() : nullptr, static_cast<int>(rows), static_cast<int>(cols),
            static_cast<int>(k), sorted, out.typed_data(), scratch.untyped_data(),
            static_cast<int64_t>(scratch.size_bytes())};
  return ffi::Error::Success();
}

// kernels/topk.cu's OrderKey: an unsigned key in the float's total order (+0.0 above -0.0).
uint32_t OrderKey(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

void TopkCpu(const Topk& p) {
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

ffi::Error TopkCpuHandler(ffi::Buffer<ffi::F32, 2> logits, ffi::Buffer<ffi::S32, 1> lo,
                          ffi::Buffer<ffi::S32, 1> hi, ffi::ResultBuffer<ffi::S32, 2> out,
                          ffi::ResultBuffer<ffi::U8, 2> scratch, int64_t cols, bool sorted,
                          bool has_lo, bool has_hi) {
  Count();
  Topk p;
  ffi::Error e = PlanTopk(logits, lo, hi, *out, *scratch, cols, sorted, has_lo, has_hi, &p);
  if (e.failure()) return e;
  return Guarded("topk", [&] { TopkCpu(p); });
}

// ================================ neg_inf_outside =============================================
// logits[r, c] := -inf for r < rows, c < cols outside [lo[r], hi[r]) (lo absent: 0), or with
// `relative` outside [0, hi[r] - lo[r]); both ends clamped to [0, cols]. Nothing else written.
// logits float32 or bfloat16 [R, S].

struct NegInf {
  void* logits;   // the result buffer (aliases the input)
  int64_t stride;
  int elem_bytes;
  int rows, cols;
  const int32_t* lo;   // nullptr: absent
  const int32_t* hi;
  bool relative;
};

ffi::Error PlanNegInf(ffi::AnyBuffer in, ffi::Buffer<ffi::S32, 1> lo, ffi::Buffer<ffi::S32, 1> hi,
                      ffi::AnyBuffer& out, int64_t rows, int64_t cols, bool relative, bool has_lo,
                      NegInf* p) {
  const char* name = "neg_inf_outside";
  auto dims = in.dimensions();
  const ffi::DataType t = in.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return Invalid(name, "logits must be float32 or bfloat16");
  }
  if (dims.size() != 2) return Invalid(name, "logits must be [R, S], got " + Dims(dims));
  if (!SameLayout(in, out)) {
    return Invalid(name, "the result must alias logits (same type and shape)");
  }
  // rows < 0: as many rows as hi has (a symbolic row count is known only here)
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
  *p = NegInf{out.untyped_data(), dims[1], static_cast<int>(ffi::ByteWidth(t)),
              static_cast<int>(rows), static_cast<int>(cols), has_lo ? lo.typed_data() : nullptr,
              hi.typed_data(), relative};
  return ffi::Error::Success();
}

template <typename Bits>
void NegInfRows(const NegInf& p, Bits neg_inf) {
  for (int r = 0; r < p.rows; ++r) {
    int a = p.lo ? p.lo[r] : 0;
    int b = p.hi[r];
    if (p.relative) {   // int32 wrap-around, as the kernel's (and torch's) subtraction
      b = static_cast<int32_t>(static_cast<uint32_t>(b) - static_cast<uint32_t>(a));
      a = 0;
    }
    a = std::min(std::max(a, 0), p.cols);
    b = std::min(std::max(b, a), p.cols);
    Bits* row = static_cast<Bits*>(p.logits) + static_cast<int64_t>(r) * p.stride;
    std::fill(row, row + a, neg_inf);
    std::fill(row + b, row + p.cols, neg_inf);
  }
}

ffi::Error NegInfCpuHandler(ffi::AnyBuffer logits, ffi::Buffer<ffi::S32, 1> lo,
                            ffi::Buffer<ffi::S32, 1> hi, ffi::Result<ffi::AnyBuffer> out,
                            int64_t rows, int64_t cols, bool relative, bool has_lo) {
  Count();
  NegInf p;
  ffi::Error e = PlanNegInf(logits, lo, hi, *out, rows, cols, relative, has_lo, &p);
  if (e.failure()) return e;
  StartFromInputCpu(logits, *out);
  if (p.elem_bytes == 4) {
    NegInfRows<uint32_t>(p, 0xff800000u);
  } else {
    NegInfRows<uint16_t>(p, static_cast<uint16_t>(0xff80u));
  }
  return ffi::Error::Success();
}

// ================================ zero_masked_tail ============================================
// d [G, Mmax, ...]: rows masked_m[g] <= m < Mmax of group g := 0 (masked_m clamped to [0, Mmax]).

struct ZeroRows {   // both zero kernels
  void* d;          // the result buffer (aliases the input)
  int64_t row_bytes;
  int groups, max_m;    // masked: G, Mmax
  int rows, block;      // padding: M, block
  const int32_t* ids;   // masked_m [G] or layout [M]
  bool skip;
};

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

ffi::Error PlanMaskedTail(ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> masked_m, ffi::AnyBuffer& out,
                          ZeroRows* p) {
  const char* name = "zero_masked_tail";
  int64_t row_bytes = 0;
  if (ffi::Error e = RowBytes(name, d, 2, &row_bytes); e.failure()) return e;
  if (!SameLayout(d, out)) return Invalid(name, "the result must alias d (same type and shape)");
  auto dims = d.dimensions();
  if (!FitsInt(dims[0]) || !FitsInt(dims[1])) {
    return Invalid(name, "d " + Dims(dims) + " too large");
  }
  if (static_cast<int64_t>(masked_m.element_count()) < dims[0]) {
    return Invalid(name, "masked_m has " + std::to_string(masked_m.element_count()) +
                             " elements, groups = " + std::to_string(dims[0]));
  }
  *p = ZeroRows{out.untyped_data(), row_bytes, static_cast<int>(dims[0]),
                static_cast<int>(dims[1]), 0, 0, masked_m.typed_data(), false};
  return ffi::Error::Success();
}

void MaskedTailCpu(const ZeroRows& p) {
  for (int g = 0; g < p.groups; ++g) {
    const int first = std::min(std::max(p.ids[g], 0), p.max_m);
    const int64_t row = static_cast<int64_t>(g) * p.max_m + first;
    std::memset(static_cast<char*>(p.d) + row * p.row_bytes, 0,
                static_cast<size_t>(p.max_m - first) * p.row_bytes);
  }
}

ffi::Error MaskedTailCpuHandler(ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> masked_m,
                                ffi::Result<ffi::AnyBuffer> out) {
  Count();
  ZeroRows p;
  if (ffi::Error e = PlanMaskedTail(d, masked_m, *out, &p); e.failure()) return e;
  StartFromInputCpu(d, *out);
  MaskedTailCpu(p);
  return ffi::Error::Success();
}

// ================================ zero_padding_rows ===========================================
// d [M, ...]: rows with layout[r] < 0 := 0, except, with skip_padding_blocks, in blocks of
// `block` rows whose first row's id is < 0 (left as they are).

ffi::Error PlanPaddingRows(ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> layout, ffi::AnyBuffer& out,
                           int64_t block, bool skip, ZeroRows* p) {
  const char* name = "zero_padding_rows";
  int64_t row_bytes = 0;
  if (ffi::Error e = RowBytes(name, d, 1, &row_bytes); e.failure()) return e;
  if (!SameLayout(d, out)) return Invalid(name, "the result must alias d (same type and shape)");
  auto dims = d.dimensions();
  if (!FitsInt(dims[0])) return Invalid(name, "d " + Dims(dims) + " too large");
  if (static_cast<int64_t>(layout.element_count()) < dims[0]) {
    return Invalid(name, "layout has " + std::to_string(layout.element_count()) +
                             " elements, rows = " + std::to_string(dims[0]));
  }
  if (skip && (block < 1 || !FitsInt(block))) {
    return Invalid(name, "block = " + std::to_string(block) + " must be >= 1");
  }
  *p = ZeroRows{out.untyped_data(), row_bytes, 0, 0, static_cast<int>(dims[0]),
                static_cast<int>(skip ? block : 1), layout.typed_data(), skip};
  return ffi::Error::Success();
}

void PaddingRowsCpu(const ZeroRows& p) {
  for (int r = 0; r < p.rows; ++r) {
    bool zero = p.ids[r] < 0;
    if (zero && p.skip) zero = p.ids[r - r % p.block] >= 0;
    if (zero) {
      std::memset(static_cast<char*>(p.d) + static_cast<int64_t>(r) * p.row_bytes, 0, p.row_bytes);
    }
  }
}

ffi::Error PaddingRowsCpuHandler(ffi::AnyBuffer d, ffi::Buffer<ffi::S32, 1> layout,
                                 ffi::Result<ffi::AnyBuffer> out, int64_t block, bool skip) {
  Count();
  ZeroRows p;
  if (ffi::Error e = PlanPaddingRows(d, layout, *out, block, skip, &p); e.failure()) return e;
  StartFromInputCpu(d, *out);
  PaddingRowsCpu(p);
  return ffi::Error::Success();
}

// ================================ paged_sanitise ==============================================
// The paged logits call's addresses brought into range (kernels/paged_sanitise.cu says what each
// output holds; jax_dg.reference.paged_mqa.paged_sanitised is the same in jax.numpy):
// lens int32 [B] or [B, next_n], table [B, W], schedule [S + 1, 2] or [0] ->
// ctx [B, next_n], table_out [B, W'] (W' >= W), schedule_out like schedule.

constexpr int64_t kSplit = 256;   // tokens per schedule split (DeepGEMM's SM90 paged kernel)

struct Sanitise {
  const int32_t* lens;
  bool one_d;
  int next_n;
  const int32_t* table;
  int rows, width, out_width, block_size, limit;
  int64_t num_blocks;
  bool zero_unused;
  const int32_t* meta;   // nullptr: no schedule to bound
  int entries;
  int32_t* ctx;
  int32_t* table_out;
  int32_t* meta_out;
};

ffi::Error PlanSanitise(ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32, 2> table,
                        ffi::Buffer<ffi::S32> meta, ffi::Buffer<ffi::S32, 2>& ctx,
                        ffi::Buffer<ffi::S32, 2>& table_out, ffi::Buffer<ffi::S32>& meta_out,
                        int64_t num_blocks, int64_t block_size, int64_t limit, bool zero_unused,
                        bool fix_schedule, Sanitise* p) {
  const char* name = "paged_sanitise";
  auto ld = lens.dimensions(), td = table.dimensions(), cd = ctx.dimensions();
  auto od = table_out.dimensions(), md = meta.dimensions();
  const int64_t rows = td[0], width = td[1], next_n = cd[1];
  if (!FitsInt(rows) || rows < 1 || !FitsInt(width) || width < 1) {
    return Invalid(name, "block_tables " + Dims(td) + " must be [B >= 1, max_blocks >= 1]");
  }
  const bool one_d = ld.size() == 1;
  if (!(one_d && ld[0] == rows) && !(ld.size() == 2 && ld[0] == rows && ld[1] == next_n)) {
    return Invalid(name, "context_lens " + Dims(ld) + " must be [B] or [B, next_n] for ctx " +
                             Dims(cd) + " and block_tables " + Dims(td));
  }
  if (cd[0] != rows || next_n < 1 || !FitsInt(next_n)) {
    return Invalid(name, "ctx " + Dims(cd) + " must be [B, next_n >= 1]");
  }
  if (od[0] != rows || od[1] < width || !FitsInt(od[1])) {
    return Invalid(name, "the table result " + Dims(od) + " must be [B, >= " +
                             std::to_string(width) + "]");
  }
  if (block_size < 1 || !FitsInt(block_size) || num_blocks < 0) {
    return Invalid(name, "block_size = " + std::to_string(block_size) + ", num_blocks = " +
                             std::to_string(num_blocks));
  }
  // limit + 2 * kSplit fits: the kernel's ceil(limit / block_size) and ceil(len / kSplit)
  if (limit < 0 || limit > width * block_size || !FitsInt(limit + 2 * kSplit + block_size)) {
    return Invalid(name, "limit = " + std::to_string(limit) + " outside [0, max_blocks * "
                             "block_size = " + std::to_string(width * block_size) + "]");
  }
  int64_t entries = 0;
  if (fix_schedule) {
    auto mo = meta_out.dimensions();
    if (md.size() != 2 || md[1] != 2 || md[0] < 1 || !FitsInt(md[0]) ||
        mo.size() != 2 || mo[0] != md[0] || mo[1] != 2) {
      return Invalid(name, "schedule " + Dims(md) + " and its result " + Dims(mo) +
                               " must both be [S + 1 >= 1, 2]");
    }
    const int64_t k = (limit + kSplit - 1) / kSplit + 1;
    if ((rows + 1) * k >= (int64_t{1} << 31)) {
      return Invalid(name, "(B + 1) * (splits per row + 1) = " + std::to_string((rows + 1) * k) +
                               " overflows the schedule's int32 keys");
    }
    entries = md[0];
  } else if (meta_out.element_count() != 0) {
    return Invalid(name, "no schedule to bound: its result must be empty");
  }
  *p = Sanitise{lens.typed_data(), one_d, static_cast<int>(next_n), table.typed_data(),
                static_cast<int>(rows), static_cast<int>(width), static_cast<int>(od[1]),
                static_cast<int>(block_size), static_cast<int>(limit), num_blocks, zero_unused,
                fix_schedule ? meta.typed_data() : nullptr, static_cast<int>(entries),
                ctx.typed_data(), table_out.typed_data(),
                fix_schedule ? meta_out.typed_data() : nullptr};
  return ffi::Error::Success();
}

bool OutOfRange(int32_t v, int64_t num_blocks) { return v < 0 || v >= num_blocks; }

int32_t RowLength(const Sanitise& p, int b, int j) {
  if (!p.one_d) return p.lens[static_cast<int64_t>(b) * p.next_n + j];
  return static_cast<int32_t>(static_cast<uint32_t>(p.lens[b]) -   // int32 wrap-around
                              static_cast<uint32_t>(p.next_n - 1 - j));
}

void SanitiseCpu(const Sanitise& p) {
  const int64_t blk = p.block_size;
  for (int b = 0; b < p.rows; ++b) {
    const int given = std::min(std::max(RowLength(p, b, p.next_n - 1), 0), p.limit);
    const int used = static_cast<int>((given + blk - 1) / blk);
    const int32_t* row = p.table + static_cast<int64_t>(b) * p.width;
    int first_bad = p.width;
    for (int c = 0; c < used; ++c) {
      if (OutOfRange(row[c], p.num_blocks)) {
        first_bad = c;
        break;
      }
    }
    const int last = static_cast<int>(std::min<int64_t>(given, first_bad * blk));
    int32_t* ctx = p.ctx + static_cast<int64_t>(b) * p.next_n;
    for (int j = 0; j + 1 < p.next_n; ++j) ctx[j] = std::min(std::max(RowLength(p, b, j), 0), last);
    ctx[p.next_n - 1] = last;
    const int live = p.zero_unused ? static_cast<int>((last + blk - 1) / blk) : p.out_width;
    int32_t* out = p.table_out + static_cast<int64_t>(b) * p.out_width;
    for (int c = 0; c < p.out_width; ++c) {
      const int32_t v = c < p.width ? row[c] : 0;
      out[c] = c >= live || OutOfRange(v, p.num_blocks) ? 0 : v;
    }
  }
  if (p.meta == nullptr) return;
  // kernels/paged_sanitise.cu's FixSchedule: keys q * k + y, bounded, then a running max
  auto last = [&](int b) { return static_cast<int64_t>(p.ctx[static_cast<int64_t>(b) * p.next_n + p.next_n - 1]); };
  auto tasks = [&](int b) { return std::max<int64_t>((last(b) + kSplit - 1) / kSplit, 1); };
  int first = p.rows - 1;
  for (int b = 0; b < p.rows; ++b) {
    if (last(b) > 0) {
      first = b;
      break;
    }
  }
  const int64_t k = (p.limit + kSplit - 1) / kSplit + 1;
  const int64_t cap = static_cast<int64_t>(p.rows - 1) * k + tasks(p.rows - 1) - 1;
  int64_t running = 0;
  for (int s = 0; s < p.entries; ++s) {
    int64_t key;
    if (s == p.entries - 1) {
      key = static_cast<int64_t>(p.rows) * k;
    } else if (s == 0) {
      key = std::min(first * k, cap);
    } else {
      const int q = std::min(std::max(p.meta[2 * s], 0), p.rows);
      const int64_t y = std::max(p.meta[2 * s + 1], 0);
      const bool over = y >= (q < p.rows ? tasks(q) : 1);
      key = std::min(over ? std::min(q + 1, p.rows) * k : q * k + y, cap);
    }
    running = std::max(running, key);
    p.meta_out[2 * s] = static_cast<int32_t>(running / k);
    p.meta_out[2 * s + 1] = static_cast<int32_t>(running % k);
  }
}

ffi::Error SanitiseCpuHandler(ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32, 2> table,
                              ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::S32, 2> ctx,
                              ffi::ResultBuffer<ffi::S32, 2> table_out,
                              ffi::ResultBuffer<ffi::S32> meta_out, int64_t num_blocks,
                              int64_t block_size, int64_t limit, bool zero_unused,
                              bool fix_schedule) {
  Count();
  Sanitise p;
  ffi::Error e = PlanSanitise(lens, table, meta, *ctx, *table_out, *meta_out, num_blocks,
                              block_size, limit, zero_unused, fix_schedule, &p);
  if (e.failure()) return e;
  SanitiseCpu(p);
  return ffi::Error::Success();
}

// ================================ CUDA ========================================================
// Only host work before the launch (no device reads, no allocation, no synchronization), so a
// call can be captured into a CUDA graph and replayed.
#ifdef JAX_DG_CUDA

// An in-place kernel's result is its input (aliased); if XLA ever hands two buffers, the result
// starts as a copy of the input, on the stream (a device copy: capture-safe).
ffi::Error StartFromInputCuda(const char* kernel, const ffi::AnyBuffer& in,
                              const ffi::AnyBuffer& out, cudaStream_t stream) {
  if (out.untyped_data() == in.untyped_data() || in.size_bytes() == 0) {
    return ffi::Error::Success();
  }
  return CudaStatus(kernel, cudaMemcpyAsync(out.untyped_data(), in.untyped_data(),
                                            in.size_bytes(), cudaMemcpyDeviceToDevice, stream));
}

ffi::Error TopkCudaHandler(cudaStream_t stream, ffi::Buffer<ffi::F32, 2> logits,
                           ffi::Buffer<ffi::S32, 1> lo, ffi::Buffer<ffi::S32, 1> hi,
                           ffi::ResultBuffer<ffi::S32, 2> out,
                           ffi::ResultBuffer<ffi::U8, 2> scratch, int64_t cols, bool sorted,
                           bool has_lo, bool has_hi) {
  Count();
  Topk p;
  ffi::Error e = PlanTopk(logits, lo, hi, *out, *scratch, cols, sorted, has_lo, has_hi, &p);
  if (e.failure()) return e;
  ClearStaleError();
  return CudaStatus("topk", JaxDgTopkRows(p.logits, p.stride, p.lo, p.hi, p.rows, p.cols, p.k,
                                          p.sorted ? 1 : 0, p.out, p.scratch, p.scratch_bytes,
                                          stream));
}

ffi::Error NegInfCudaHandler(cudaStream_t stream, ffi::AnyBuffer logits,
                             ffi::Buffer<ffi::S32, 1> lo, ffi::Buffer<ffi::S32, 1> hi,
                             ffi::Result<ffi::AnyBuffer> out, int64_t rows, int64_t cols,
                             bool relative, bool has_lo) {
  const char* name = "neg_inf_outside";
  Count();
  NegInf p;
  ffi::Error e = PlanNegInf(logits, lo, hi, *out, rows, cols, relative, has_lo, &p);
  if (e.failure()) return e;
  ClearStaleError();
  e = StartFromInputCuda(name, logits, *out, stream);
  if (e.failure()) return e;
  return CudaStatus(name, JaxDgNegInfOutside(p.logits, p.stride, p.elem_bytes, p.rows, p.cols,
                                             p.lo, p.hi, p.relative ? 1 : 0, stream));
}

ffi::Error MaskedTailCudaHandler(cudaStream_t stream, ffi::AnyBuffer d,
                                 ffi::Buffer<ffi::S32, 1> masked_m,
                                 ffi::Result<ffi::AnyBuffer> out) {
  const char* name = "zero_masked_tail";
  Count();
  ZeroRows p;
  ffi::Error e = PlanMaskedTail(d, masked_m, *out, &p);
  if (e.failure()) return e;
  if (!Aligned16(*out)) return Invalid(name, "d is not 16-byte aligned");
  ClearStaleError();
  e = StartFromInputCuda(name, d, *out, stream);
  if (e.failure()) return e;
  // The kernel puts groups on gridDim.y (at most 65535): larger G launches in slices.
  constexpr int kMaxGroups = 65535;
  for (int g = 0; g < p.groups; g += kMaxGroups) {
    const int n = std::min(kMaxGroups, p.groups - g);
    char* d_g = static_cast<char*>(p.d) + static_cast<int64_t>(g) * p.max_m * p.row_bytes;
    e = CudaStatus(name, JaxDgZeroMaskedTail(d_g, p.row_bytes, n, p.max_m, p.ids + g, stream));
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error PaddingRowsCudaHandler(cudaStream_t stream, ffi::AnyBuffer d,
                                  ffi::Buffer<ffi::S32, 1> layout, ffi::Result<ffi::AnyBuffer> out,
                                  int64_t block, bool skip) {
  const char* name = "zero_padding_rows";
  Count();
  ZeroRows p;
  ffi::Error e = PlanPaddingRows(d, layout, *out, block, skip, &p);
  if (e.failure()) return e;
  if (!Aligned16(*out)) return Invalid(name, "d is not 16-byte aligned");
  ClearStaleError();
  e = StartFromInputCuda(name, d, *out, stream);
  if (e.failure()) return e;
  return CudaStatus(name, JaxDgZeroPaddingRows(p.d, p.row_bytes, p.rows, p.block, p.ids,
                                               p.skip ? 1 : 0, stream));
}

ffi::Error SanitiseCudaHandler(cudaStream_t stream, ffi::Buffer<ffi::S32> lens,
                               ffi::Buffer<ffi::S32, 2> table, ffi::Buffer<ffi::S32> meta,
                               ffi::ResultBuffer<ffi::S32, 2> ctx,
                               ffi::ResultBuffer<ffi::S32, 2> table_out,
                               ffi::ResultBuffer<ffi::S32> meta_out, int64_t num_blocks,
                               int64_t block_size, int64_t limit, bool zero_unused,
                               bool fix_schedule) {
  Count();
  Sanitise p;
  ffi::Error e = PlanSanitise(lens, table, meta, *ctx, *table_out, *meta_out, num_blocks,
                              block_size, limit, zero_unused, fix_schedule, &p);
  if (e.failure()) return e;
  ClearStaleError();
  return CudaStatus("paged_sanitise",
                    JaxDgPagedSanitise(p.lens, p.one_d ? 1 : 0, p.next_n, p.table, p.rows, p.width,
                                       p.out_width, p.num_blocks, p.block_size, p.limit,
                                       p.zero_unused ? 1 : 0, p.meta, p.entries, p.ctx,
                                       p.table_out, p.meta_out, stream));
}

#endif  // JAX_DG_CUDA

// One binding per kernel; the CUDA one adds XLA's stream in front (B is dependent, hence
// `.template`).
template <typename B>
auto TopkBinding(B b) {
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

template <typename B>
auto NegInfBinding(B b) {
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

template <typename B>
auto MaskedTailBinding(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()             // d [G, Mmax, ...]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()   // masked_m [G]
      .template Ret<ffi::AnyBuffer>();            // d again (aliased)
}

template <typename B>
auto PaddingRowsBinding(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()             // d [M, ...]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()   // layout [M]
      .template Ret<ffi::AnyBuffer>()             // d again (aliased)
      .template Attr<int64_t>("block")
      .template Attr<bool>("skip_padding_blocks");
}

template <typename B>
auto SanitiseBinding(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()      // context_lens [B] or [B, next_n]
      .template Arg<ffi::Buffer<ffi::S32, 2>>()   // block_tables [B, W]
      .template Arg<ffi::Buffer<ffi::S32>>()      // schedule [S + 1, 2] or [0]
      .template Ret<ffi::Buffer<ffi::S32, 2>>()   // ctx [B, next_n]
      .template Ret<ffi::Buffer<ffi::S32, 2>>()   // table [B, W' >= W]
      .template Ret<ffi::Buffer<ffi::S32>>()      // schedule [S + 1, 2] or [0]
      .template Attr<int64_t>("num_blocks")
      .template Attr<int64_t>("block_size")
      .template Attr<int64_t>("limit")
      .template Attr<bool>("zero_unused")
      .template Attr<bool>("fix_schedule");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeTopkCpu, TopkCpuHandler, TopkBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeNegInfCpu, NegInfCpuHandler,
                              NegInfBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeMaskedTailCpu, MaskedTailCpuHandler,
                              MaskedTailBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativePaddingRowsCpu, PaddingRowsCpuHandler,
                              PaddingRowsBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDgNativeSanitiseCpu, SanitiseCpuHandler,
                              SanitiseBinding(ffi::Ffi::Bind()));

#ifdef JAX_DG_CUDA
// Command-buffer compatible: the CUDA plugin refuses traits at registration, so they are the
// symbol's own.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxDgNativeTopkCuda, TopkCudaHandler,
    TopkBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxDgNativeNegInfCuda, NegInfCudaHandler,
    NegInfBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxDgNativeMaskedTailCuda, MaskedTailCudaHandler,
    MaskedTailBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxDgNativePaddingRowsCuda, PaddingRowsCudaHandler,
    PaddingRowsBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxDgNativeSanitiseCuda, SanitiseCudaHandler,
    SanitiseBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

// ffi/cast_fp8.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDgNativeCastFp8Cpu);
#ifdef JAX_DG_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDgNativeCastFp8Cuda);
#endif

namespace {

nb::dict Platforms(XLA_FFI_Handler* cpu, XLA_FFI_Handler* cuda) {
  nb::dict d;
  d["cpu"] = nb::capsule(reinterpret_cast<void*>(cpu));
  if (cuda != nullptr) d["CUDA"] = nb::capsule(reinterpret_cast<void*>(cuda));
  return d;
}

#ifdef JAX_DG_CUDA
constexpr bool kCudaBuilt = true;
#define JAX_DG_CUDA_HANDLER(name) name
#else
constexpr bool kCudaBuilt = false;
#define JAX_DG_CUDA_HANDLER(name) nullptr
#endif

// target name -> {platform: handler capsule}
nb::dict Handlers() {
  nb::dict d;
  d["jax_dg_native_topk"] = Platforms(JaxDgNativeTopkCpu, JAX_DG_CUDA_HANDLER(JaxDgNativeTopkCuda));
  d["jax_dg_native_neg_inf_outside"] =
      Platforms(JaxDgNativeNegInfCpu, JAX_DG_CUDA_HANDLER(JaxDgNativeNegInfCuda));
  d["jax_dg_native_zero_masked_tail"] =
      Platforms(JaxDgNativeMaskedTailCpu, JAX_DG_CUDA_HANDLER(JaxDgNativeMaskedTailCuda));
  d["jax_dg_native_zero_padding_rows"] =
      Platforms(JaxDgNativePaddingRowsCpu, JAX_DG_CUDA_HANDLER(JaxDgNativePaddingRowsCuda));
  d["jax_dg_native_paged_sanitise"] =
      Platforms(JaxDgNativeSanitiseCpu, JAX_DG_CUDA_HANDLER(JaxDgNativeSanitiseCuda));
  d["jax_dg_native_cast_fp8"] =
      Platforms(JaxDgNativeCastFp8Cpu, JAX_DG_CUDA_HANDLER(JaxDgNativeCastFp8Cuda));
  return d;
}
#undef JAX_DG_CUDA_HANDLER

int MaxK() {
#ifdef JAX_DG_CUDA
  return JaxDgTopkMaxK();
#else
  return kMaxK;
#endif
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax_dg's own kernels as native XLA FFI handlers (see ffi/native.cc)";
  m.def("handlers", &Handlers);
  m.def("cuda_built", []() { return kCudaBuilt; });
  m.def("max_k", &MaxK);
  m.def(
      "topk_scratch_bytes",
      [](int64_t cols, int64_t k, bool sorted) { return jax_dg_topk::ScratchBytes(1, cols, k, sorted); },
      "Scratch bytes a row the top-k's CUDA kernel splits rows of `cols` keys with (0: never split).");
  m.def("call_count", []() { return g_calls.load(std::memory_order_relaxed); });
}
