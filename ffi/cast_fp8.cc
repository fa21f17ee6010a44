// jax_dg's fused FP8 casts (kernels/cast_fp8.cu) as typed XLA FFI handlers: the CUDA launch and
// its C++ twin on CPU, bitwise equal (and both bitwise DeepGEMM's torch quantisers).
//
// x [B, R, C] (bfloat16 or float32, C % 16 == 0); valid_rows int32 [B] (or [0], absent): rows
// r >= valid_rows[b] are read as 0. Results, each [0] when not asked for (rows_out / cols_out):
//   token mode (per_block false): q fp8 [B, R, C] and sq f32 [B, ceil(C/128), align(R, 4)]
//     (MN-major, padding 0), 1 x 128 blocks along C; qt fp8 [B, C, Rt] (Rt = align(R, 16), rows
//     past R zero) and sqt f32 [B, ceil(Rt/128), align(C, 4)], 1 x 128 blocks along R of x.T;
//   block mode: q and sq f32 [B, ceil(R/128), ceil(C/128)] (128 x 128 blocks); qt = q.T [B, C, Rt]
//     and sqt = sq.T [B, ceil(C/128), ceil(R/128)].
// sf = max(amax, 1e-4) * fl(1/448) (torch's CUDA `/ 448.0`; UE8M0: rounded up to a power of
// two), values RNE(x * (1 / sf)).

#include <cmath>
#include <cstring>
#include <vector>

#include "handlers.h"

#ifdef JAX_DG_CUDA
extern "C" int JaxDgCastFp8(const void* x, int in_f32, int batch, int rows, int cols,
                            const int* valid_rows, int per_block, int ue8m0, uint8_t* q, float* sq,
                            uint8_t* qt, float* sqt, cudaStream_t stream);
#endif

namespace jax_dg_native {
namespace {

constexpr int64_t kTile = 128;

int64_t Cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t Align(int64_t a, int64_t b) { return Cdiv(a, b) * b; }

struct CastParams {
  const void* x;
  bool in_f32;
  int batch, rows, cols, rows_t;
  const int32_t* valid_rows;   // nullptr: absent
  bool per_block, ue8m0;
  uint8_t* q;                  // nullptr: not asked for (and sq with it, in token mode)
  float* sq;
  uint8_t* qt;                 // nullptr: not asked for (sqt with it)
  float* sqt;
  bool aligned;                // every buffer 16-byte aligned (the CUDA kernel's accesses)
};

ffi::Error Expect(const ffi::AnyBuffer& buf, const char* what, ffi::DataType type,
                  std::initializer_list<int64_t> dims) {
  auto d = buf.dimensions();
  const bool ok = buf.element_type() == type && d.size() == dims.size() &&
                  std::equal(d.begin(), d.end(), dims.begin());
  if (ok) return ffi::Error::Success();
  std::string want = "[";
  for (auto it = dims.begin(); it != dims.end(); ++it) {
    want += (it == dims.begin() ? "" : ", ") + std::to_string(*it);
  }
  return Invalid("cast_fp8", std::string(what) + " is " + Dims(d) + ", expected " + want + "]");
}

ffi::Error PlanCast(CastParams* p, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 1> valid_rows,
                    ffi::AnyBuffer& q, ffi::AnyBuffer& sq, ffi::AnyBuffer& qt, ffi::AnyBuffer& sqt,
                    bool per_block, bool ue8m0, bool has_valid, bool rows_out, bool cols_out) {
  const char* name = "cast_fp8";
  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return Invalid(name, "x must be float32 or bfloat16");
  }
  auto d = x.dimensions();
  if (d.size() != 3) return Invalid(name, "x must be [B, R, C], got " + Dims(d));
  const int64_t b = d[0], r = d[1], c = d[2];
  if (!FitsInt(b) || b > 65535 || !FitsInt(r) || Cdiv(r, kTile) > 65535 || !FitsInt(c) ||
      Align(r, 16) * c > INT64_MAX / 4) {
    return Invalid(name, "x " + Dims(d) + " too large (B <= 65535, R / 128 < 65536)");
  }
  if (c % 16 != 0) return Invalid(name, "x's columns " + std::to_string(c) + " % 16 != 0");
  if (has_valid && static_cast<int64_t>(valid_rows.element_count()) < b) {
    return Invalid(name, "valid_rows has " + std::to_string(valid_rows.element_count()) +
                             " elements, batch = " + std::to_string(b));
  }
  const int64_t rt = Align(r, 16);
  const auto f8 = ffi::DataType::F8E4M3FN, f32 = ffi::DataType::F32;
  ffi::Error e = ffi::Error::Success();
  auto check = [&](const ffi::AnyBuffer& buf, const char* what, ffi::DataType type,
                   std::initializer_list<int64_t> dims) {
    if (e.success()) e = Expect(buf, what, type, dims);
  };
  if (rows_out) {
    check(q, "q", f8, {b, r, c});
    if (per_block) check(sq, "sq", f32, {b, Cdiv(r, kTile), Cdiv(c, kTile)});
    else check(sq, "sq", f32, {b, Cdiv(c, kTile), Align(r, 4)});
  } else {
    check(q, "q (not asked for)", f8, {0});
    check(sq, "sq (not asked for)", f32, {0});
  }
  if (cols_out) {
    check(qt, "qt", f8, {b, c, rt});
    if (per_block) check(sqt, "sqt", f32, {b, Cdiv(c, kTile), Cdiv(r, kTile)});
    else check(sqt, "sqt", f32, {b, Cdiv(rt, kTile), Align(c, 4)});
  } else {
    check(qt, "qt (not asked for)", f8, {0});
    check(sqt, "sqt (not asked for)", f32, {0});
  }
  if (e.failure()) return e;
  bool aligned = true;
  for (const ffi::AnyBuffer* buf : {&x, &q, &sq, &qt, &sqt}) aligned = aligned && Aligned16(*buf);
  *p = CastParams{x.untyped_data(), t == ffi::DataType::F32, static_cast<int>(b), static_cast<int>(r),
               static_cast<int>(c), static_cast<int>(rt), has_valid ? valid_rows.typed_data() : nullptr,
               per_block, ue8m0,
               rows_out ? static_cast<uint8_t*>(q.untyped_data()) : nullptr,
               rows_out ? static_cast<float*>(sq.untyped_data()) : nullptr,
               cols_out ? static_cast<uint8_t*>(qt.untyped_data()) : nullptr,
               cols_out ? static_cast<float*>(sqt.untyped_data()) : nullptr, aligned};
  return ffi::Error::Success();
}

// ---- the arithmetic, as kernels/cast_fp8.cu does it -------------------------------------------

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// max of |a| and |b| on their bit patterns: NaN above +inf, so it propagates
float AbsBitsMax(float a, float b) { return FromBits(std::max(Bits(a) & 0x7fffffffu, Bits(b) & 0x7fffffffu)); }

float ScaleFor(float amax, bool ue8m0) {
  // max(amax, 1e-4f) * fl(1/448): DeepGEMM's `/ 448.0` as torch runs it on the GPU
  const float sf = FromBits(std::max(Bits(amax), 0x38d1b717u)) * FromBits(0x3b124925u);
  if (!ue8m0) return sf;
  const uint32_t bits = Bits(sf) & 0x7fffffffu;
  const int e = std::min(std::max(static_cast<int>(bits >> 23) + ((bits & 0x7fffffu) != 0), 1), 254);
  return FromBits(static_cast<uint32_t>(e) << 23);
}

// float -> float8_e4m3fn, round to nearest even, finite values past 448 saturate, NaN -> 0x7f
// (PTX cvt.rn.satfinite.e4m3x2.f32, what the kernel uses)
uint8_t ToE4m3(float f) {
  const uint32_t u = Bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a < 0x3c800000u) {   // below 2^-6: subnormal steps of 2^-9 (the products are exact)
    return sign | static_cast<uint8_t>(std::nearbyint(FromBits(a) * 512.0f));
  }
  uint32_t mant = a >> 20;                       // exponent and 3 mantissa bits
  const uint32_t rest = a & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (mant & 1))) ++mant;
  const uint32_t e4m3 = mant - (120u << 3);      // rebias 127 -> 7
  return sign | static_cast<uint8_t>(std::min(e4m3, 0x7eu));
}

template <typename In>
float Load(const void* x, int64_t i);
template <>
float Load<float>(const void* x, int64_t i) { return static_cast<const float*>(x)[i]; }
template <>
float Load<uint16_t>(const void* x, int64_t i) {
  return FromBits(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
}

// One 1 x 128 block: its scale from at(0..n), then out(i, value) for each element; the scale.
template <typename At, typename Out>
float CastLine(int64_t n, bool ue8m0, At at, Out out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = AbsBitsMax(amax, at(i));
  const float sf = ScaleFor(amax, ue8m0), inv = 1.0f / sf;
  for (int64_t i = 0; i < n; ++i) out(i, ToE4m3(at(i) * inv));
  return sf;
}

template <typename In>
void CastCpu(const CastParams& p) {
  const int64_t R = p.rows, C = p.cols, Rt = p.rows_t, KB = Cdiv(C, kTile), MB = Cdiv(R, kTile);
  const int64_t MBt = Cdiv(Rt, kTile), Ra = Align(R, 4), Ca = Align(C, 4);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t valid = p.valid_rows ? std::min<int64_t>(std::max(p.valid_rows[b], 0), R) : R;
    // x[b, m, k], 0 past the valid rows (and past R: the transposed cast's padding rows)
    auto at = [&](int64_t m, int64_t k) {
      return m < valid ? Load<In>(p.x, (b * R + m) * C + k) : 0.0f;
    };
    auto cast_block = [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1, float sf) {
      const float inv = 1.0f / sf;
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t k = k0; k < k1; ++k) {
          const uint8_t v = ToE4m3(at(m, k) * inv);
          if (p.q && m < R) p.q[(b * R + m) * C + k] = v;
          if (p.qt) p.qt[(b * C + k) * Rt + m] = v;
        }
      }
    };
    if (p.per_block) {
      for (int64_t mb = 0; mb < MB; ++mb) {
        for (int64_t kb = 0; kb < KB; ++kb) {
          const int64_t m0 = mb * kTile, k0 = kb * kTile, k1 = std::min(C, k0 + kTile);
          float amax = 0.0f;
          for (int64_t m = m0; m < std::min(R, m0 + kTile); ++m) {
            for (int64_t k = k0; k < k1; ++k) amax = AbsBitsMax(amax, at(m, k));
          }
          const float sf = ScaleFor(amax, p.ue8m0);
          cast_block(m0, std::min(p.qt ? Rt : R, m0 + kTile), k0, k1, sf);
          if (p.sq) p.sq[(b * MB + mb) * KB + kb] = sf;
          if (p.sqt) p.sqt[(b * KB + kb) * MB + mb] = sf;
        }
      }
      continue;
    }
    if (p.q) {   // per row, 128-column blocks
      for (int64_t kb = 0; kb < KB; ++kb) {
        float* sq = p.sq + (b * KB + kb) * Ra;
        const int64_t k0 = kb * kTile, n = std::min(C - k0, kTile);
        for (int64_t m = 0; m < R; ++m) {
          sq[m] = CastLine(n, p.ue8m0, [&](int64_t i) { return at(m, k0 + i); },
                           [&](int64_t i, uint8_t v) { p.q[(b * R + m) * C + k0 + i] = v; });
        }
        std::fill(sq + R, sq + Ra, 0.0f);
      }
    }
    if (p.qt) {  // per column, 128-row blocks (rows past R: zeros)
      for (int64_t mb = 0; mb < MBt; ++mb) {
        float* sqt = p.sqt + (b * MBt + mb) * Ca;
        const int64_t m0 = mb * kTile, n = std::min(Rt - m0, kTile);
        for (int64_t k = 0; k < C; ++k) {
          sqt[k] = CastLine(n, p.ue8m0, [&](int64_t i) { return at(m0 + i, k); },
                            [&](int64_t i, uint8_t v) { p.qt[(b * C + k) * Rt + m0 + i] = v; });
        }
        std::fill(sqt + C, sqt + Ca, 0.0f);
      }
    }
  }
}

struct CastFp8 {
  using Params = CastParams;

  static ffi::Error Plan(Params* p, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 1> valid_rows,
                         ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> sq,
                         ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::AnyBuffer> sqt,
                         bool per_block, bool ue8m0, bool has_valid, bool rows_out, bool cols_out) {
    return PlanCast(p, x, valid_rows, *q, *sq, *qt, *sqt, per_block, ue8m0, has_valid, rows_out,
                    cols_out);
  }

  static ffi::Error Cpu(const Params& p) {
    return Guarded("cast_fp8", [&] { p.in_f32 ? CastCpu<float>(p) : CastCpu<uint16_t>(p); });
  }

#ifdef JAX_DG_CUDA
  static ffi::Error Cuda(cudaStream_t stream, const Params& p) {
    const char* name = "cast_fp8";
    if (!p.aligned) return Invalid(name, "a buffer is not 16-byte aligned");
    return CudaStatus(name, JaxDgCastFp8(p.x, p.in_f32 ? 1 : 0, p.batch, p.rows, p.cols,
                                         p.valid_rows, p.per_block ? 1 : 0, p.ue8m0 ? 1 : 0, p.q,
                                         p.sq, p.qt, p.sqt, stream));
  }
#endif

  template <typename B>
  static auto Bind(B b) {
    return std::move(b)
        .template Arg<ffi::AnyBuffer>()             // x [B, R, C], float32 or bfloat16
        .template Arg<ffi::Buffer<ffi::S32, 1>>()   // valid_rows [B] or [0]
        .template Ret<ffi::AnyBuffer>()             // q
        .template Ret<ffi::AnyBuffer>()             // sq
        .template Ret<ffi::AnyBuffer>()             // qt
        .template Ret<ffi::AnyBuffer>()             // sqt
        .template Attr<bool>("per_block")
        .template Attr<bool>("ue8m0")
        .template Attr<bool>("has_valid")
        .template Attr<bool>("rows_out")
        .template Attr<bool>("cols_out");
  }
};

}  // namespace
}  // namespace jax_dg_native

JAX_DG_NATIVE_HANDLERS(CastFp8, jax_dg_native::CastFp8);
