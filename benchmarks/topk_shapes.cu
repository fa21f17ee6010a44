// kernels/topk.cu's kernel shapes (keys per thread x CTAs per row) timed against each other and
// the copy floor, on random normal logits, without Python: for choosing JaxDgTopkShape's table,
// and a quick target for compute-sanitizer. Each shape's indices are checked against a CPU
// top-k on a few rows and against the default shape's on all rows.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/topk_shapes.cu kernels/topk.cu \
//        kernels/topk_long.cu -o /tmp/topk_shapes
//   /tmp/topk_shapes          every bench shape, k 512/2048/4096, sorted and not
//   /tmp/topk_shapes small    a few small cases, each shape once (for the sanitizer)
//   /tmp/topk_shapes tiny     the same with fewer rows (for racecheck, which is slow)
//   /tmp/topk_shapes one ROWS COLS K SORTED [ITEMS CLUSTER [GRID [TIES]]]   one call (for a profiler
//                             or a sanitizer; GRID as JaxDgTopkRowsShaped's `grid`: n > 1 is
//                             n persistent clusters, so a few rows still cross rows); <= 64 rows
//                             are checked against the CPU
//   /tmp/topk_shapes time ROWS COLS K SORTED [TIES]   one shape timed (and then the baseline)
//   /tmp/topk_shapes split ROWS COLS K SORTED   rows split over CTAs (kernels/topk_split.h)
//                             against a cluster a row, and the split's two launches' work timed
//                             as plain top-k
//   /tmp/topk_shapes phases ROWS COLS K SORTED   with -DTOPK_PHASES (kernel and harness): the
//                             cycles a row's cluster spends in each phase, from its first thread
//
// With -DTOPK_BASELINE and a previous kernels/topk.cu compiled with its entry points renamed
// (-DJaxDgTopkRows=BaselineTopkRows -DJaxDgTopkRowsShaped=BaselineTopkRowsShaped
// -DJaxDgTopkShape=BaselineTopkShape -DJaxDgTopkMaxK=BaselineTopkMaxK), each default shape is
// also timed on the baseline, interleaved in the same process.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cuda_runtime.h>

extern "C" int JaxDgTopkShape(int cols, int* items, int* cluster_size);
extern "C" int JaxDgTopkRowsShaped(const float* logits, int64_t stride, const int* lo,
                                   const int* hi, int rows, int cols, int k, int sorted, int* out,
                                   int items, int cluster_size, int grid, cudaStream_t stream);
extern "C" int JaxDgTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                             int rows, int cols, int k, int sorted, int* out, void* scratch,
                             int64_t scratch_bytes, cudaStream_t stream);
extern "C" int JaxDgTopkSplits(int rows, int cols, int k, int sorted);
extern "C" int JaxDgTopkRowsSplit(const float* logits, int64_t stride, const int* lo, const int* hi,
                                  int rows, int cols, int k, int sorted, int* out, int chunk_cols,
                                  void* scratch, int64_t scratch_bytes, int launches,
                                  cudaStream_t stream);
#ifdef TOPK_PHASES
extern "C" int JaxDgTopkPhases(unsigned long long* host);
#endif
#ifdef TOPK_BASELINE
extern "C" int BaselineTopkRows(const float* logits, int64_t stride, const int* lo, const int* hi,
                                int rows, int cols, int k, int sorted, int* out, cudaStream_t stream);
#endif

// JaxDgTopkRows' scratch, as the FFI handler gives it: sized for any split (32768 candidates, 8
// bytes each, a row), set up by Scratch(rows).
void* g_scratch = nullptr;
int64_t g_scratch_bytes = 0;

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = static_cast<cudaError_t>(x);                                   \
    if (e_ != cudaSuccess) {                                                        \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Normal logits (Box-Muller on a hash); ties > 0: rounded to 1/ties (many equal values).
__global__ void Fill(float* x, int64_t n, uint64_t seed, int ties) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = (Hash(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.0f) * 2.3283064e-10f;
    const float u2 = Hash(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) * 2.3283064e-10f;
    float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (ties) v = rintf(v * ties) / ties;
    x[i] = v;
  }
}

uint32_t OrderKey(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The contract on one row (all columns candidates unless -inf/NaN).
std::vector<int> CpuRow(const float* x, int cols, int k, bool sorted) {
  std::vector<uint64_t> c;
  for (int i = 0; i < cols; ++i) {
    if (x[i] > -INFINITY) c.push_back(uint64_t(OrderKey(x[i])) << 32 | uint32_t(~i));
  }
  const size_t take = std::min(c.size(), size_t(k));
  std::partial_sort(c.begin(), c.begin() + take, c.end(), std::greater<uint64_t>());
  std::vector<int> out(k, -1);
  for (size_t t = 0; t < take; ++t) out[t] = int(~uint32_t(c[t]));
  if (!sorted) std::sort(out.begin(), out.begin() + take);
  return out;
}

// The first of rows [0, rows) where the kernel's output (got, [rows, k]) differs from the CPU's,
// or -1.
int FirstMismatch(const float* host, const std::vector<int>& got, int rows, int cols, int k, bool sorted) {
  for (int r = 0; r < rows; ++r) {
    if (CpuRow(host + int64_t(r) * cols, cols, k, sorted) !=
        std::vector<int>(got.begin() + int64_t(r) * k, got.begin() + int64_t(r + 1) * k)) {
      return r;
    }
  }
  return -1;
}

void Scratch(int rows) {
  if (int64_t(rows) * 32768 * 8 <= g_scratch_bytes) return;
  if (g_scratch) CHECK(cudaFree(g_scratch));
  g_scratch_bytes = int64_t(rows) * 32768 * 8;
  CHECK(cudaMalloc(&g_scratch, g_scratch_bytes));
}

// The top-k as the FFI handler calls it.
int Topk(const float* x, int rows, int cols, int k, int sorted, int* out) {
  return JaxDgTopkRows(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, g_scratch, g_scratch_bytes, 0);
}

float TimeUs(int reps, const std::function<void()>& f) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms * 1000 / reps);
  }
  return best;
}

int main(int argc, char** argv) {
  const bool tiny = argc > 1 && std::strcmp(argv[1], "tiny") == 0;   // small, fewer rows: racecheck
  const bool small = tiny || (argc > 1 && std::strcmp(argv[1], "small") == 0);
  if (argc > 5 && std::strcmp(argv[1], "one") == 0) {
    const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]), k = std::atoi(argv[4]);
    const int sorted = std::atoi(argv[5]);
    const int ties = argc > 9 ? std::atoi(argv[9]) : 0;
    float* x;
    int* out;
    CHECK(cudaMalloc(&x, int64_t(rows) * cols * 4));
    CHECK(cudaMalloc(&out, int64_t(rows) * k * 4));
    Fill<<<1024, 256>>>(x, int64_t(rows) * cols, 7, ties);
    Scratch(rows);
    for (int i = 0; i < 2; ++i) {   // the second call is the one to profile (nothing to set up)
      if (argc > 7) {
        CHECK(JaxDgTopkRowsShaped(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, std::atoi(argv[6]),
                                  std::atoi(argv[7]),
                                  argc > 8 ? std::atoi(argv[8]) : !sorted, 0));   // JaxDgTopkRows' grid
      } else {
        CHECK(Topk(x, rows, cols, k, sorted, out));
      }
    }
    CHECK(cudaDeviceSynchronize());
    if (rows <= 64) {   // small runs (the sanitizer's) are checked against the CPU, every row
      std::vector<float> host(int64_t(rows) * cols);
      std::vector<int> got(int64_t(rows) * k);
      CHECK(cudaMemcpy(host.data(), x, host.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
      const int r = FirstMismatch(host.data(), got, rows, cols, k, sorted);
      if (r >= 0) {
        std::printf("MISMATCH vs CPU: rows %d cols %d k %d sorted %d ties %d row %d\n", rows, cols, k,
                    sorted, ties, r);
        return 1;
      }
      std::printf("one: rows %d cols %d k %d sorted %d ties %d agree with the CPU\n", rows, cols, k, sorted, ties);
    }
    return 0;
  }
#ifdef TOPK_PHASES
  if (argc > 5 && std::strcmp(argv[1], "phases") == 0) {
    const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]), k = std::atoi(argv[4]);
    const int sorted = std::atoi(argv[5]);
    float* x;
    int* out;
    CHECK(cudaMalloc(&x, int64_t(rows) * cols * 4));
    CHECK(cudaMalloc(&out, int64_t(rows) * k * 4));
    Fill<<<1024, 256>>>(x, int64_t(rows) * cols, 99, 0);
    Scratch(rows);
    unsigned long long c[16];
    CHECK(Topk(x, rows, cols, k, sorted, out));
    CHECK(cudaDeviceSynchronize());
    CHECK(JaxDgTopkPhases(c));   // zeroes them
    for (int i = 0; i < 10; ++i) CHECK(Topk(x, rows, cols, k, sorted, out));
    CHECK(cudaDeviceSynchronize());
    CHECK(JaxDgTopkPhases(c));
    const char* names[7] = {"load wait", "keys", "pass 0", "passes 1-2", "slots", "sort", "output"};
    double all = 0;
    for (int i = 0; i < 7; ++i) all += c[i];
    std::printf("phases rows %d cols %d k %d sorted %d: %.0f cycles a row (%llu rows):", rows, cols, k, sorted,
                all / c[7], c[7]);
    for (int i = 0; i < 7; ++i) std::printf("  %s %.0f (%.0f%%)", names[i], double(c[i]) / c[7], 100.0 * c[i] / all);
    std::printf("\n");
    const char* steps[6] = {"counts", "scan", "read", "scatter", "in-bucket ranks", "final scatter"};
    if (c[8] > 0) {   // the bucket sort ran: its steps, over every row of the calls
      std::printf("  bucket sort, cycles a row:");
      for (int i = 0; i < 6; ++i) std::printf("  %s %.0f", steps[i], double(c[8 + i]) / c[7]);
      std::printf("\n");
    }
    return 0;
  }
#endif
  if (argc > 5 && std::strcmp(argv[1], "split") == 0) {   // a split row against a cluster a row
    const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]), k = std::atoi(argv[4]);
    const int sorted = std::atoi(argv[5]);
    const int64_t chunks = (cols + 32767) / 32768;
    if (chunks < 2 || chunks * k > 32768) {
      std::printf("split rows %d cols %d k %d: not a split shape\n", rows, cols, k);
      return 1;
    }
    // the split's two launches' work as plain top-k: [rows * chunks, part] unsorted (the chunks'
    // columns, from the same buffer, sized for them), then [rows, chunks * k] (random logits in
    // place of the candidates' values)
    const int part = int(((cols + chunks - 1) / chunks + 3) / 4 * 4);   // jax_dg_topk::ChunkCols
    float* x;
    int* out;
    CHECK(cudaMalloc(&x, std::max<int64_t>(int64_t(rows) * cols, rows * chunks * part) * 4));
    CHECK(cudaMalloc(&out, int64_t(rows) * chunks * k * 4));
    Fill<<<1024, 256>>>(x, std::max<int64_t>(int64_t(rows) * cols, rows * chunks * part), 99, 0);
    Scratch(rows);
    int items = 0, cluster = 0;
    CHECK(JaxDgTopkShape(cols, &items, &cluster) ? 0 : 1);
    auto split = [&] { return JaxDgTopkRowsSplit(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, 32768, g_scratch, g_scratch_bytes, 3, 0); };
    auto split1 = [&] { return JaxDgTopkRowsSplit(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, 32768, g_scratch, g_scratch_bytes, 1, 0); };
    auto split2 = [&] { return JaxDgTopkRowsSplit(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, 32768, g_scratch, g_scratch_bytes, 2, 0); };
    auto clustered = [&] {
      return JaxDgTopkRowsShaped(x, cols, nullptr, nullptr, rows, cols, k, sorted, out, items, cluster, !sorted, 0);
    };
    auto first = [&] { return Topk(x, int(rows * chunks), part, k, 0, out); };
    auto second = [&] { return Topk(x, rows, int(chunks * k), k, sorted, out); };
    CHECK(split());
    CHECK(clustered());
    CHECK(first());
    CHECK(second());
    CHECK(cudaDeviceSynchronize());
    const float a = TimeUs(20, split), b = TimeUs(20, clustered), c = TimeUs(20, first), d = TimeUs(20, second);
    const float a1 = TimeUs(20, split1), a2 = TimeUs(20, split2);
    std::printf("split rows %d cols %d k %d sorted %d: split %.1f us (launches %.1f + %.1f), %d x %d a cluster %.1f us "
                "(x%.2f); as plain top-k: [%lld, %d] unsorted %.1f + [%d, %lld] %.1f\n", rows, cols, k, sorted, a, a1,
                a2, items, cluster, b, b / a, (long long)(rows * chunks), part, c, rows, (long long)(chunks * k), d);
    return 0;
  }
  if (argc > 5 && std::strcmp(argv[1], "time") == 0) {   // one shape: default (and baseline) us
    const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]), k = std::atoi(argv[4]);
    const int sorted = std::atoi(argv[5]);
    float* x;
    int *out, *out2;
    CHECK(cudaMalloc(&x, int64_t(rows) * cols * 4));
    CHECK(cudaMalloc(&out, int64_t(rows) * k * 4));
    CHECK(cudaMalloc(&out2, int64_t(rows) * k * 4));
    Fill<<<1024, 256>>>(x, int64_t(rows) * cols, 99, argc > 6 ? std::atoi(argv[6]) : 0);
    Scratch(rows);
    CHECK(Topk(x, rows, cols, k, sorted, out));
    const float us = TimeUs(20, [&] { Topk(x, rows, cols, k, sorted, out); });
    std::printf("time rows %d cols %d k %d sorted %d: %.1f us", rows, cols, k, sorted, us);
#ifdef TOPK_BASELINE
    CHECK(BaselineTopkRows(x, cols, nullptr, nullptr, rows, cols, k, sorted, out2, 0));
    const float base = TimeUs(20, [&] { BaselineTopkRows(x, cols, nullptr, nullptr, rows, cols, k, sorted, out2, 0); });
    std::vector<int> a(int64_t(rows) * k), b(a.size());
    CHECK(cudaMemcpy(a.data(), out, a.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), out2, b.size() * 4, cudaMemcpyDeviceToHost));
    std::printf("  baseline %.1f us (x%.2f)%s", base, base / us, a == b ? "" : "  MISMATCH vs baseline");
#endif
    std::printf("\n");
    return 0;
  }
  struct Case { int rows, cols; };
  std::vector<Case> cases = small ? std::vector<Case>{{3, 1000}, {5, 8191}, {4, 30001}, {2, 131072}, {2, 140000}, {2, 262144}, {2, 270000},
                                                      {270, 30001}}   // rows past one persistent grid (2 x 132 clusters)
                                  : std::vector<Case>{{2048, 8192}, {4096, 32768}, {64, 65536}, {256, 131072}, {256, 8192}};
  if (small && !tiny) cases.insert(cases.end(), {{300, 1000}, {300, 8191}, {3, 32769}, {300, 40000}, {2, 1000000}});
  std::vector<int> ks = small ? std::vector<int>{1, 700, 4096} : std::vector<int>{512, 2048, 4096};
  int failures = 0;
  for (const Case& cs : cases) {
    const int64_t n = int64_t(cs.rows) * cs.cols;
    float* x;
    int *out, *ref;
    CHECK(cudaMalloc(&x, n * 4));
    CHECK(cudaMalloc(&out, int64_t(cs.rows) * 4096 * 4));
    CHECK(cudaMalloc(&ref, int64_t(cs.rows) * 4096 * 4));
    float* copy;
    CHECK(cudaMalloc(&copy, n * 4));
    for (int ties : {0, 8}) {
      Fill<<<1024, 256>>>(x, n, 1234 + cs.cols, ties);
      Scratch(cs.rows);
      CHECK(cudaDeviceSynchronize());
      if (ties && !small) continue;   // timing on random data only
      const float copy_us = small ? 0 : TimeUs(10, [&] { cudaMemcpyAsync(copy, x, n * 4, cudaMemcpyDeviceToDevice); });
      // a copy reads and writes: the floor of a read-only pass is half its time
      const float floor_us = copy_us / 2;
      std::vector<float> host(std::min<int64_t>(n, int64_t(4) * cs.cols));
      CHECK(cudaMemcpy(host.data(), x, host.size() * 4, cudaMemcpyDeviceToHost));
      for (int k : ks) {
        for (int sorted : {0, 1}) {
          // default shape: checked against the CPU on the first rows
          CHECK(Topk(x, cs.rows, cs.cols, k, sorted, ref));
          CHECK(cudaDeviceSynchronize());
          std::vector<int> got(int64_t(cs.rows) * k);
          CHECK(cudaMemcpy(got.data(), ref, got.size() * 4, cudaMemcpyDeviceToHost));
          const int check_rows = std::min<int64_t>(cs.rows, host.size() / cs.cols);
          const int bad_row = FirstMismatch(host.data(), got, check_rows, cs.cols, k, sorted);
          if (bad_row >= 0) {
            std::printf("MISMATCH vs CPU: rows %d cols %d k %d sorted %d ties %d row %d\n", cs.rows,
                        cs.cols, k, sorted, ties, bad_row);
            ++failures;
          }
          int d_items = 0, d_cluster = 0;
          const bool fits = JaxDgTopkShape(cs.cols, &d_items, &d_cluster);
          const float def_us = small ? 0 : TimeUs(20, [&] {
            Topk(x, cs.rows, cs.cols, k, sorted, out);
          });
          if (!small) {
            char shape[32];
            if (JaxDgTopkSplits(cs.rows, cs.cols, k, sorted) == 1) {
              std::snprintf(shape, sizeof(shape), "split");
            } else {
              std::snprintf(shape, sizeof(shape), "%2d x %d", d_items, d_cluster);
            }
            std::printf("rows %5d cols %6d k %4d %-8s default (%s): %8.1f us  floor %6.1f  x%.2f",
                        cs.rows, cs.cols, k, sorted ? "sorted" : "unsorted", shape, def_us,
                        floor_us, def_us / floor_us);
#ifdef TOPK_BASELINE
            CHECK(BaselineTopkRows(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, 0));
            CHECK(cudaDeviceSynchronize());
            std::vector<int> base(got.size());
            CHECK(cudaMemcpy(base.data(), out, base.size() * 4, cudaMemcpyDeviceToHost));
            const float base_us = TimeUs(20, [&] {
              BaselineTopkRows(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, 0);
            });
            std::printf("  baseline %8.1f us (x%.2f)%s", base_us, base_us / def_us,
                        base == got ? "" : "  MISMATCH vs baseline");
            if (base != got) ++failures;
#endif
            std::printf("\n");
          }
          for (int chunk : {8192, 16384, 32768}) {   // a split row's chunk sizes (the default: 32768)
            if (cs.cols <= 32768) break;
            const int rc = JaxDgTopkRowsSplit(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, chunk, g_scratch,
                                              g_scratch_bytes, 3, 0);
            if (rc == cudaErrorInvalidValue) continue;   // not split (too many candidates)
            CHECK(rc);
            CHECK(cudaDeviceSynchronize());
            std::vector<int> other(got.size());
            CHECK(cudaMemcpy(other.data(), out, other.size() * 4, cudaMemcpyDeviceToHost));
            if (other != got) {
              std::printf("MISMATCH split in chunks of %d: cols %d k %d sorted %d ties %d\n", chunk, cs.cols, k,
                          sorted, ties);
              ++failures;
            }
            if (small) continue;
            const float us = TimeUs(20, [&] {
              JaxDgTopkRowsSplit(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, chunk, g_scratch,
                                 g_scratch_bytes, 3, 0);
            });
            std::printf("%58s (split, chunks <= %5d): %8.1f us\n", "", chunk, us);
          }
          if (!fits) continue;
          for (int persistent : {0, 1}) {   // the default shape on either grid
            CHECK(JaxDgTopkRowsShaped(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, d_items, d_cluster, persistent, 0));
            CHECK(cudaDeviceSynchronize());
            std::vector<int> other(got.size());
            CHECK(cudaMemcpy(other.data(), out, other.size() * 4, cudaMemcpyDeviceToHost));
            if (other != got) {
              std::printf("MISMATCH %s grid: cols %d k %d sorted %d ties %d\n", persistent ? "persistent" : "a cluster a row",
                          cs.cols, k, sorted, ties);
              ++failures;
            }
            if (!small) {
              const float us = TimeUs(20, [&] {
                JaxDgTopkRowsShaped(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, d_items, d_cluster, persistent, 0);
              });
              std::printf("%58s (%2d x %d, %s): %8.1f us\n", "", d_items, d_cluster, persistent ? "persistent" : "a cluster a row", us);
            }
          }
          for (int items : {8, 16, 32, 64}) {
            for (int cluster : {1, 2, 4, 8}) {
              if (int64_t(items) * cluster * 512 < cs.cols) continue;
              if (cluster > 1 && int64_t(items) * (cluster / 2) * 512 >= cs.cols) continue;   // smallest cluster per items only
              if (items == d_items && cluster == d_cluster) continue;
              const int rc = JaxDgTopkRowsShaped(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, items, cluster, 1, 0);
              if (rc == cudaErrorInvalidValue) continue;   // a shape the kernel is not built for
              CHECK(rc);
              CHECK(cudaDeviceSynchronize());
              std::vector<int> other(got.size());
              CHECK(cudaMemcpy(other.data(), out, other.size() * 4, cudaMemcpyDeviceToHost));
              if (other != got) {
                std::printf("MISMATCH between shapes: cols %d k %d sorted %d ties %d: %d x %d\n", cs.cols, k,
                            sorted, ties, items, cluster);
                ++failures;
              }
              if (small) continue;
              const float us = TimeUs(20, [&] {
                JaxDgTopkRowsShaped(x, cs.cols, nullptr, nullptr, cs.rows, cs.cols, k, sorted, out, items, cluster, 1, 0);
              });
              std::printf("%58s (%2d x %d): %8.1f us\n", "", items, cluster, us);
            }
          }
        }
      }
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(copy));
  }
  std::printf(failures ? "FAILED: %d mismatches\n" : "all shapes agree with the CPU and each other\n", failures);
  return failures ? 1 : 0;
}
