// jax_dg's own CUDA kernel: DeepGEMM's FP8 casts (deep_gemm/utils/math.py) fused, one pass over
// the input. Per 128 x 128 tile of x [rows, cols] (bfloat16 or float32) it writes, as asked:
//
//   token mode (1 x 128 blocks):
//     q   [rows, cols] fp8, each row's 128-column blocks cast with their own scale, and that
//         scale MN-major and TMA-aligned, sq [ceil(cols/128), align(rows, 4)] (what DeepGEMM's
//         SM90 kernels read; padding columns 0): no layout pass after the cast;
//     qt  [cols, align(rows, 16)] fp8, the per-token cast of x.T (each column's 128-row blocks,
//         rows past `rows` zero), and its scales sqt [ceil(align(rows, 16)/128), align(cols, 4)]
//         MN-major: the wgrad's operand, without a transpose pass;
//   block mode (128 x 128 blocks): q, its scales sq [ceil(rows/128), ceil(cols/128)], and qt =
//         q.T [cols, align(rows, 16)] (the dgrad's w.T) with sqt = sq.T.
//
// Arithmetic, bitwise DeepGEMM's on the GPU: sf = max(amax, 1e-4) * fl(1/448) (torch's CUDA
// `/ 448.0` multiplies by the reciprocal; UE8M0: rounded up to a power of two), values
// x * (1 / sf) (an IEEE reciprocal) rounded to nearest-even float8_e4m3fn. amax is
// taken on the bit patterns of |x|, so a NaN in a block makes its scale NaN, as torch's and
// XLA's max do.
//
// A thread holds 8 rows x 8 columns of its tile in registers (16-byte loads; bfloat16 kept
// packed, so 4 CTAs fit an SM and overlap each other's phases): row maxima by
// shuffles within 16 lanes, column maxima by a shuffle and a 4 KiB shared reduction. The
// transposed values go through a 16 KiB shared tile (8-byte chunks XOR-swizzled: conflict-free
// writes and reads) and leave as 16-byte stores of whole 128-byte rows. No allocation, one
// launch on the given stream; cols % 16 == 0 and 16-byte aligned buffers (the caller's checks).

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;     // 16 column groups of 8 x 16 row groups of 8
constexpr uint32_t kFloorBits = 0x38d1b717u;   // 1e-4f
constexpr uint32_t kInv448Bits = 0x3b124925u;  // fl(1 / 448)

struct Cast {
  const void* x;
  int rows, cols, rows_t;         // rows_t = align(rows, 16): qt's row length
  const int* valid_rows;          // [batch] or nullptr: rows >= valid_rows[b] read as 0
  uint8_t* q;
  float* sq;
  uint8_t* qt;
  float* sqt;
  bool ue8m0;
};

__device__ __forceinline__ float AbsBitsMax(float a, float b) {
  // |a|, |b| as unsigned bit patterns: the float order, with NaN above +inf (propagates)
  return __uint_as_float(max(__float_as_uint(a) & 0x7fffffffu, __float_as_uint(b) & 0x7fffffffu));
}

__device__ __forceinline__ float ScaleFor(float amax, bool ue8m0) {
  // DeepGEMM's `amax / 448.0` as torch runs it on the GPU: times the float reciprocal
  const float sf = __fmul_rn(__uint_as_float(max(__float_as_uint(amax), kFloorBits)), __uint_as_float(kInv448Bits));
  if (!ue8m0) return sf;
  const uint32_t bits = __float_as_uint(sf) & 0x7fffffffu;
  int e = static_cast<int>(bits >> 23) + ((bits & 0x7fffffu) != 0);
  e = min(max(e, 1), 254);
  return __uint_as_float(static_cast<uint32_t>(e) << 23);
}

// 8 values times inv, packed as 8 float8_e4m3fn bytes (RNE; |x * inv| <= 448 up to rounding,
// so satfinite never clamps a finite product; NaN stays NaN)
__device__ __forceinline__ uint2 Pack8(const float* v, float inv) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * h], inv), __fmul_rn(v[4 * h + 1], inv)), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * h + 2], inv), __fmul_rn(v[4 * h + 3], inv)), __NV_SATFINITE, __NV_E4M3);
    w[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  return make_uint2(w[0], w[1]);
}

// A thread's 8 x 8 values as loaded (bfloat16 stays packed: half the registers, so more
// CTAs per SM overlap their loads with the others' casts and stores).
template <typename In>
struct Tile;

template <>
struct Tile<__nv_bfloat16> {
  uint4 raw[8];
  __device__ __forceinline__ void Load(int i, const __nv_bfloat16* p) { raw[i] = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void Zero(int i) { raw[i] = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ float At(int i, int j) const {
    const uint32_t w = (&raw[i].x)[j >> 1];
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
  }
};

template <>
struct Tile<float> {
  float v[8][8];
  __device__ __forceinline__ void Load(int i, const float* p) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[i][0] = a.x; v[i][1] = a.y; v[i][2] = a.z; v[i][3] = a.w;
    v[i][4] = b.x; v[i][5] = b.y; v[i][6] = b.z; v[i][7] = b.w;
  }
  __device__ __forceinline__ void Zero(int i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[i][j] = 0.0f;
  }
  __device__ __forceinline__ float At(int i, int j) const { return v[i][j]; }
};

template <typename In, bool kBlock>
__global__ void __launch_bounds__(kThreads, sizeof(In) == 2 ? 4 : 2)
CastFp8(Cast p) {
  __shared__ float col_max[kThreads / 32][kTile];
  __shared__ float col_sf[kTile];
  __shared__ float block_max[kThreads / 32];
  __shared__ __align__(16) uint8_t tile_t[kTile * kTile];   // [col][row], 8-byte chunks swizzled

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = tid & 15, rg = tid >> 4;            // columns 8c..8c+7, rows 8rg..8rg+7
  const int b = blockIdx.z;
  const int k0 = blockIdx.x * kTile, m0 = blockIdx.y * kTile;
  const int rows = p.rows, cols = p.cols;
  const int valid = p.valid_rows ? min(max(p.valid_rows[b], 0), rows) : rows;
  const In* x = static_cast<const In*>(p.x) + static_cast<int64_t>(b) * rows * cols;
  const int k = k0 + 8 * c;
  const bool k_in = k < cols;                       // cols % 16 == 0: a vector is all in or out

  Tile<In> v;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = m0 + 8 * rg + i;
    if (k_in && m < valid) {
      v.Load(i, x + static_cast<int64_t>(m) * cols + k);
    } else {
      v.Zero(i);
    }
  }

  // --- rows: per-row maxima and, per token, each row cast as soon as its maximum is known -----
  // (column maxima gathered on the way; per block, the tile's maximum first, then the rows)
  uint8_t* q = p.q ? p.q + static_cast<int64_t>(b) * rows * cols : nullptr;
  const int64_t sq_rows = (cols + kTile - 1) / kTile, sq_len = (rows + 3) / 4 * 4;
  auto store_row = [&](int i, float sf) {
    const int m = m0 + 8 * rg + i;
    if (k_in && m < rows) {
      float row[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) row[j] = v.At(i, j);
      *reinterpret_cast<uint2*>(q + static_cast<int64_t>(m) * cols + k) = Pack8(row, __frcp_rn(sf));
    }
    if (!kBlock && c == 0 && m < sq_len) {
      p.sq[(static_cast<int64_t>(b) * sq_rows + blockIdx.x) * sq_len + m] = m < rows ? sf : 0.0f;
    }
  };
  float col_amax[8], tile_amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) col_amax[j] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float r = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      r = AbsBitsMax(r, v.At(i, j));
      col_amax[j] = AbsBitsMax(col_amax[j], v.At(i, j));
    }
    if (kBlock) {
      tile_amax = AbsBitsMax(tile_amax, r);
    } else if (q) {
#pragma unroll
      for (int s = 8; s >= 1; s >>= 1) r = AbsBitsMax(r, __shfl_xor_sync(0xffffffffu, r, s));
      store_row(i, ScaleFor(r, p.ue8m0));
    }
  }
  float tile_sf = 0.0f;
  if (kBlock) {
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) tile_amax = AbsBitsMax(tile_amax, __shfl_xor_sync(0xffffffffu, tile_amax, s));
    if (lane == 0) block_max[warp] = tile_amax;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) t = AbsBitsMax(t, block_max[w]);
    tile_sf = ScaleFor(t, p.ue8m0);
    if (tid == 0) {
      const int kb = blockIdx.x, mb = blockIdx.y, kbs = gridDim.x, mbs = gridDim.y;
      if (p.sq) p.sq[(static_cast<int64_t>(b) * mbs + mb) * kbs + kb] = tile_sf;
      if (p.sqt) p.sqt[(static_cast<int64_t>(b) * kbs + kb) * mbs + mb] = tile_sf;
    }
    if (q) {
#pragma unroll
      for (int i = 0; i < 8; ++i) store_row(i, tile_sf);
    }
  }
  if (!p.qt) return;

  // --- columns: qt = the transposed cast, through the shared tile ----------------------------
  if (!kBlock) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      col_amax[j] = AbsBitsMax(col_amax[j], __shfl_xor_sync(0xffffffffu, col_amax[j], 16));
    }
    if (lane < 16) {
#pragma unroll
      for (int j = 0; j < 8; ++j) col_max[warp][8 * c + j] = col_amax[j];
    }
    __syncthreads();
    if (tid < kTile) {
      float t = 0.0f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) t = AbsBitsMax(t, col_max[w][tid]);
      const float sf = ScaleFor(t, p.ue8m0);
      col_sf[tid] = sf;
      const int kk = k0 + tid;
      const int64_t sqt_rows = (p.rows_t + kTile - 1) / kTile, sqt_len = (cols + 3) / 4 * 4;
      if (kk < sqt_len) {
        p.sqt[(static_cast<int64_t>(b) * sqt_rows + blockIdx.y) * sqt_len + kk] = kk < cols ? sf : 0.0f;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float col[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) col[i] = v.At(i, j);
    const float sf = kBlock ? tile_sf : col_sf[8 * c + j];
    // row 8c + j of the tile, logical chunk rg at physical chunk rg ^ c
    *reinterpret_cast<uint2*>(tile_t + (8 * c + j) * kTile + 8 * (rg ^ c)) = Pack8(col, __frcp_rn(sf));
  }
  __syncthreads();
  uint8_t* qt = p.qt + static_cast<int64_t>(b) * cols * p.rows_t;
#pragma unroll
  for (int it = 0; it < kTile * kTile / 16 / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int kr = idx >> 3, pair = idx & 7, cr = kr >> 3;   // tile row, 16-byte pair, its writer's c
    uint4 u = *reinterpret_cast<const uint4*>(tile_t + kr * kTile + 16 * (pair ^ (cr >> 1)));
    if (cr & 1) u = make_uint4(u.z, u.w, u.x, u.y);          // logical chunk 2*pair sat high
    const int kk = k0 + kr, mm = m0 + 16 * pair;
    if (kk < cols && mm < p.rows_t) {
      *reinterpret_cast<uint4*>(qt + static_cast<int64_t>(kk) * p.rows_t + mm) = u;
    }
  }
}

template <typename In>
cudaError_t Launch(const Cast& p, int batch, bool block, cudaStream_t stream) {
  const dim3 grid((p.cols + kTile - 1) / kTile, (p.rows + kTile - 1) / kTile, batch);
  if (block) {
    CastFp8<In, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    CastFp8<In, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

// x: bfloat16 (in_f32 0) or float32 [batch, rows, cols]; outputs as in the header (null: not
// written; in block mode sq and sqt are the tile scales). rows >= 1, cols % 16 == 0, batch <=
// 65535, rows / 128 < 65536; every buffer 16-byte aligned.
extern "C" int JaxDgCastFp8(const void* x, int in_f32, int batch, int rows, int cols,
                            const int* valid_rows, int per_block, int ue8m0, uint8_t* q, float* sq,
                            uint8_t* qt, float* sqt, cudaStream_t stream) {
  if (batch == 0 || rows == 0 || cols == 0) return 0;
  const Cast p{x, rows, cols, (rows + 15) / 16 * 16, valid_rows, q, sq, qt, sqt, ue8m0 != 0};
  const cudaError_t e = in_f32 ? Launch<float>(p, batch, per_block != 0, stream)
                               : Launch<__nv_bfloat16>(p, batch, per_block != 0, stream);
  return static_cast<int>(e);
}
