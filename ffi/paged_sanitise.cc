// jax_dg's index sanitising of the paged logits call (kernels/paged_sanitise.cu) as typed XLA FFI
// handlers: the CUDA launches and their C++ twin on CPU, bitwise equal.
//
// The paged logits call's addresses brought into range (kernels/paged_sanitise.cu says what each
// output holds; jax_dg.reference.paged_mqa.paged_sanitised is the same in jax.numpy):
// lens int32 [B] or [B, next_n], table [B, W], schedule [S + 1, 2] or [0] ->
// ctx [B, next_n], table_out [B, W'] (W' >= W), schedule_out like schedule.

#include "handlers.h"

#ifdef JAX_DG_CUDA
extern "C" int JaxDgPagedSanitise(const int* lens, int one_d, int next_n, const int* table, int rows,
                                  int width, int out_width, int64_t num_blocks, int block_size,
                                  int limit, int zero_unused, const int* meta, int entries,
                                  int* ctx, int* table_out, int* meta_out, cudaStream_t stream);
#endif

namespace jax_dg_native {
namespace {

constexpr int64_t kSplit = 256;   // tokens per schedule split (DeepGEMM's SM90 paged kernel)

struct SanitiseParams {
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

bool OutOfRange(int32_t v, int64_t num_blocks) { return v < 0 || v >= num_blocks; }

int32_t RowLength(const SanitiseParams& p, int b, int j) {
  if (!p.one_d) return p.lens[static_cast<int64_t>(b) * p.next_n + j];
  return static_cast<int32_t>(static_cast<uint32_t>(p.lens[b]) -   // int32 wrap-around
                              static_cast<uint32_t>(p.next_n - 1 - j));
}

void SanitiseCpu(const SanitiseParams& p) {
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

struct Sanitise {
  using Params = SanitiseParams;

  static ffi::Error Plan(Params* p, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32, 2> table,
                         ffi::Buffer<ffi::S32> meta, ffi::ResultBuffer<ffi::S32, 2> ctx_out,
                         ffi::ResultBuffer<ffi::S32, 2> table_result,
                         ffi::ResultBuffer<ffi::S32> meta_result, int64_t num_blocks,
                         int64_t block_size, int64_t limit, bool zero_unused, bool fix_schedule) {
    ffi::Buffer<ffi::S32, 2>& ctx = *ctx_out;
    ffi::Buffer<ffi::S32, 2>& table_out = *table_result;
    ffi::Buffer<ffi::S32>& meta_out = *meta_result;
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
    *p = SanitiseParams{lens.typed_data(), one_d, static_cast<int>(next_n), table.typed_data(),
                  static_cast<int>(rows), static_cast<int>(width), static_cast<int>(od[1]),
                  static_cast<int>(block_size), static_cast<int>(limit), num_blocks, zero_unused,
                  fix_schedule ? meta.typed_data() : nullptr, static_cast<int>(entries),
                  ctx.typed_data(), table_out.typed_data(),
                  fix_schedule ? meta_out.typed_data() : nullptr};
    return ffi::Error::Success();
  }

  static ffi::Error Cpu(const Params& p) {
    SanitiseCpu(p);
    return ffi::Error::Success();
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    return CudaStatus("paged_sanitise",
                      JaxDgPagedSanitise(p.lens, p.one_d ? 1 : 0, p.next_n, p.table, p.rows,
                                         p.width, p.out_width, p.num_blocks, p.block_size, p.limit,
                                         p.zero_unused ? 1 : 0, p.meta, p.entries, p.ctx,
                                         p.table_out, p.meta_out, stream));
  }
#endif

  template <typename B>
  static auto Bind(B b) {
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
};

}  // namespace
}  // namespace jax_dg_native

JAX_DG_NATIVE_HANDLERS(Sanitise, jax_dg_native::Sanitise);
