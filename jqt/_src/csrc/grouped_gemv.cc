// jqt's native XLA:CPU kernels: few-row matmuls with 4-bit weights in groups (int4, NF4),
// "jqt_grouped_gemv", and with int8 weights per output channel, "jqt_channel_gemv" (codes
// packed (N, K)) and "jqt_channel_gemv_kn" ((K, N); also with group scales), and with fp8
// weights per output channel,
// "jqt_fp8_gemv_kn" (below).
//
//   out[m, n] = sum_g scale[g, n] * sum_{k in group g} x[m, k] * (code[k, n] - round(zp[g, n]))
//
// or, with a 16-entry table (NF4), table[code[k, n] + 8] in place of the bracket.
//
// x: float32 (M, K); codes: uint8 (K / 2, N), two signed 4-bit codes per byte along K (the
// low nibble holds the even row of K, the high nibble the odd one: jqt's packed "kn"
// layout); scale and zp: float32 (K / group_size, N), zp empty when symmetric, or (1, N) for
// codes with one scale per output channel (group_size then only splits K into the blocks
// the threads share); table: float32 (16,) or empty; layer: int32 scalar.
//
// Stacked layers: codes (L, K / 2, N) with scale and zp (L, K / group_size, N) hold L
// layers' weights (a lax.scan over stacked layers), and the kernel reads layer
// clamp(layer, 0, L - 1) of them in place (as lax.dynamic_index_in_dim would pick it,
// without the copy). Both kernels take the layer operand; 2-D codes are one layer.
//
// The codes are read once, in place, and decoded in registers: each byte row of the weight
// is XORed with 0x88 (the nibbles become code + 8, in 0..15), widened, converted to float32
// (or looked up in the table) and multiplied into float32 sums over the group (AVX2 + FMA,
// or AVX-512 where the CPU has it: each column's operations the same, in the same order);
// the "+ 8" of int codes is removed with 8 x summed by the same fused multiply-adds, so
// zero codes give 0 exactly (a row whose group's x could make that overflow, inf - inf,
// takes exact_group instead). A group's sums are exact integers times x's float32 values,
// summed in float32: the same arithmetic as a float32 matmul of the decoded weight, in another
// order (but the offset, taken off after the sums, cancels with x of one sign: a rounding
// error up to about 8 sum|x| float32 steps, docs/performance.md). The groups are split over XLA's intra-op thread pool, each thread's share of the
// codes read front to back with a software prefetch 2 KiB ahead.
//
// Built by jqt/_src/native.py with the C++ compiler found at run time and XLA's FFI headers
// (jax.ffi.include_dir()); registered as the FFI target "jqt_grouped_gemv".
#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <strings.h>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define JQT_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// acc[m][0:W] += x[m][2r] * lo(row r) + x[m][2r+1] * hi(row r), over byte rows r0..r1 of the
// columns n0..n0+W; nibbles as code + 8.
// The value of a nibble (code + 8): itself, or its entry of the table.
inline float nibble(const float* table, unsigned u) { return table ? table[u] : float(u); }

// The columns n0..W-1 of byte row r (row: its columns from n0's base) added into acc, every
// row of x, scalar: the fused multiply-adds the vector loops below make, in their order.
inline void rows_columns(const float* x, int64_t K, int M, const uint8_t* row, int64_t r,
                         int64_t n0, int64_t W, float* acc, const float* table) {
  for (int64_t n = n0; n < W; ++n) {
    const uint8_t u = row[n] ^ 0x88;
    for (int m = 0; m < M; ++m)
      acc[m * W + n] = std::fma(x[m * K + 2 * r + 1], nibble(table, u >> 4),
                                std::fma(x[m * K + 2 * r], nibble(table, u & 15), acc[m * W + n]));
  }
}

void rows_scalar(const float* x, int64_t K, int M, const uint8_t* w, int64_t N,
                 int64_t r0, int64_t r1, float* acc, int64_t W, int64_t n0, const float* table) {
  for (int64_t r = r0; r < r1; ++r) rows_columns(x, K, M, w + r * N + n0, r, 0, W, acc, table);
}

#ifdef JQT_X86
// 8 nibbles (code + 8, one per 32-bit lane) -> float32: converted, or looked up in the table
// (two 8-entry halves, chosen by the nibble's bit 3).
template <bool LUT>
__attribute__((target("avx2,fma"))) inline __m256 values(__m256i u, __m256 lo_half, __m256 hi_half) {
  if (!LUT) return _mm256_cvtepi32_ps(u);
  const __m256 a = _mm256_permutevar8x32_ps(lo_half, u), b = _mm256_permutevar8x32_ps(hi_half, u);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));
}

template <int M, bool LUT>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* __restrict x, int64_t K,
                                                   const uint8_t* __restrict w, int64_t N,
                                                   int64_t r0, int64_t r1,
                                                   float* __restrict acc, int64_t W,
                                                   int64_t n0, const float* table) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));
  const __m256i low = _mm256_set1_epi32(15);
  const __m256 t0 = LUT ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
  const __m256 t1 = LUT ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * N + n0;
    __m256 xe[M], xo[M];
    for (int m = 0; m < M; ++m) {
      xe[m] = _mm256_set1_ps(x[m * K + 2 * r]);
      xo[m] = _mm256_set1_ps(x[m * K + 2 * r + 1]);
    }
    int64_t n = 0;
    for (; n + 16 <= W; n += 16) {
      // 2 KiB ahead in the order the codes are read (the next rows when W is the whole row)
      if ((n & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + n + 2048), _MM_HINT_T0);
      const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + n)), flip);
      const __m256i va = _mm256_cvtepu8_epi32(b), vb = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
      const __m256 la = values<LUT>(_mm256_and_si256(va, low), t0, t1);
      const __m256 ha = values<LUT>(_mm256_srli_epi32(va, 4), t0, t1);
      const __m256 lb = values<LUT>(_mm256_and_si256(vb, low), t0, t1);
      const __m256 hb = values<LUT>(_mm256_srli_epi32(vb, 4), t0, t1);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * W + n;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        a0 = _mm256_fmadd_ps(xo[m], ha, _mm256_fmadd_ps(xe[m], la, a0));
        a1 = _mm256_fmadd_ps(xo[m], hb, _mm256_fmadd_ps(xe[m], lb, a1));
        _mm256_storeu_ps(a, a0);
        _mm256_storeu_ps(a + 8, a1);
      }
    }
    rows_columns(x, K, M, row, r, n, W, acc, table);  // the rest, in the same order
  }
}

bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");  // every AVX2 CPU has F16C
  return ok;
}

// AVX-512 (F, BW): the 4-bit and int8 / fp8 (K, N) kernels and the 4-bit decode run 16
// columns per instruction where the CPU has it, unless JQT_NATIVE_ISA=avx2 (read once, when
// the library is first used). Each column's operations are the AVX2 loop's, in its order:
// the same numbers (where two NaNs meet, the compiler's operand order may pass on the other).
bool has_avx512() {
  static const bool ok = [] {
    const char* isa = std::getenv("JQT_NATIVE_ISA");
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           !(isa && strcasecmp(isa, "avx2") == 0);
  }();
  return ok;
}

// 16 nibbles (code + 8) -> float32: converted, or the table's entry (one permute).
template <bool LUT>
__attribute__((target("avx512f,avx512bw,avx2,fma"))) inline __m512 values512(__m512i u, __m512 t) {
  return LUT ? _mm512_permutexvar_ps(u, t) : _mm512_cvtepi32_ps(u);
}

template <int M, bool LUT>
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void rows_avx512(const float* __restrict x, int64_t K,
                                                             const uint8_t* __restrict w, int64_t N,
                                                             int64_t r0, int64_t r1,
                                                             float* __restrict acc, int64_t W,
                                                             int64_t n0, const float* table) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));
  const __m512i low = _mm512_set1_epi32(15);
  const __m512 t = LUT ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * N + n0;
    __m512 xe[M], xo[M];
    for (int m = 0; m < M; ++m) {
      xe[m] = _mm512_set1_ps(x[m * K + 2 * r]);
      xo[m] = _mm512_set1_ps(x[m * K + 2 * r + 1]);
    }
    int64_t n = 0;
    for (; n + 32 <= W; n += 32) {
      if ((n & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + n + 2048), _MM_HINT_T0);
      const __m512i va = _mm512_cvtepu8_epi32(
          _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + n)), flip));
      const __m512i vb = _mm512_cvtepu8_epi32(
          _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + n + 16)), flip));
      const __m512 la = values512<LUT>(_mm512_and_si512(va, low), t);
      const __m512 ha = values512<LUT>(_mm512_srli_epi32(va, 4), t);
      const __m512 lb = values512<LUT>(_mm512_and_si512(vb, low), t);
      const __m512 hb = values512<LUT>(_mm512_srli_epi32(vb, 4), t);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * W + n;
        __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + 16);
        a0 = _mm512_fmadd_ps(xo[m], ha, _mm512_fmadd_ps(xe[m], la, a0));
        a1 = _mm512_fmadd_ps(xo[m], hb, _mm512_fmadd_ps(xe[m], lb, a1));
        _mm512_storeu_ps(a, a0);
        _mm512_storeu_ps(a + 16, a1);
      }
    }
    rows_columns(x, K, M, row, r, n, W, acc, table);  // the rest, in the same order
  }
}
#endif

// Calls f(m0, tile) for each tile of up to 4 rows of x from row m0, with the tile's row count
// a compile-time constant (std::integral_constant) for the kernels' templates.
template <typename F>
void row_tiles(int64_t M, const F& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: f(m0, std::integral_constant<int, 1>{}); break;
      case 2: f(m0, std::integral_constant<int, 2>{}); break;
      case 3: f(m0, std::integral_constant<int, 3>{}); break;
      default: f(m0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// Whether a row of x has a group of gs values whose sum |x| is not below lim (or NaN): the
// rows the kernels compute as x times the decoded weight, summed in K order in one part.
bool huge_group(const float* x, int64_t M, int64_t K, int64_t gs, float lim) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += gs) {
      float ax = 0.f;
      for (int64_t k = k0; k < k0 + gs; ++k) ax += std::fabs(x[m * K + k]);
      if (!(ax < lim)) return true;
    }
  return false;
}

// Where a group's sums with the offset taken off could be infinite (an infinite or NaN x,
// or x so large that x times (code + 8) overflows: then inf - inf is NaN), the row's share
// of the group is computed instead as x times the decoded weight, (code - round(zp)) *
// scale, in float32 (what the XLA formulation computes), added to the row's output ``o``
// in K order: a sum that overflows stays at its infinity, as a float dot's does (a group
// summed apart first, +inf, and the next, -inf, gave NaN; such a call runs in one part,
// huge_group). Only such rows and groups take this (scalar) path.
void exact_group(const float* x, const uint8_t* w, int64_t N, const float* sg, const float* zg,
                 int64_t g, int64_t gs, float* o) {
  for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
    const uint8_t* row = w + (k / 2) * N;
    const float xk = x[k];
    for (int64_t n = 0; n < N; ++n) {
      const unsigned u = (k & 1) ? (row[n] >> 4) : (row[n] & 15u);
      const float code = float(u >= 8 ? int(u) - 16 : int(u));
      o[n] += xk * ((code - (zg ? __builtin_roundevenf(zg[n]) : 0.f)) * sg[n]);
    }
  }
}

// out[m][0:N] = the sum over the groups g0..g1 (every row and column).
void groups(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
            const float* scale, const float* zp, const float* table, int64_t gs, float* out,
            int64_t g0, int64_t g1, bool per_channel) {
  const int64_t R = gs / 2;
  std::vector<float> acc(static_cast<size_t>(M * N));
  std::fill(out, out + M * N, 0.f);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    row_tiles(M, [&](int64_t m0, auto tile) {
      constexpr int mm = decltype(tile)::value;
      const float* xm = x + m0 * K;
      float* am = acc.data() + m0 * N;
#ifdef JQT_X86
      if (has_avx512()) {
        if (table) return rows_avx512<mm, true>(xm, K, w, N, g * R, (g + 1) * R, am, N, 0, table);
        return rows_avx512<mm, false>(xm, K, w, N, g * R, (g + 1) * R, am, N, 0, table);
      }
      if (has_avx2()) {
        if (table) return rows_avx2<mm, true>(xm, K, w, N, g * R, (g + 1) * R, am, N, 0, table);
        return rows_avx2<mm, false>(xm, K, w, N, g * R, (g + 1) * R, am, N, 0, table);
      }
#endif
      rows_scalar(xm, K, mm, w, N, g * R, (g + 1) * R, am, N, 0, table);
    });
    const float* sg = scale + (per_channel ? 0 : g * N);
    const float* zg = zp ? zp + (per_channel ? 0 : g * N) : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      float* o = out + m * N;
      const float* a = acc.data() + m * N;
      if (table) {  // table values: no offset to remove
        for (int64_t n = 0; n < N; ++n) o[n] += sg[n] * a[n];
        continue;
      }
      // the group's sum of x, for the zero point; x times the +8 summed by the fused
      // multiply-adds that summed the codes (so a group of zero codes gives 0 exactly)
      float xs = 0.f, ax = 0.f, z8 = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) xs += x[m * K + k], ax += std::fabs(x[m * K + k]);
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 2)
        z8 = std::fma(x[m * K + k + 1], 8.f, std::fma(x[m * K + k], 8.f, z8));
      // |a| <= 15 ax and |(8 + zp) xs| <= 16 ax (zero points within the codes' range): finite
      // below FLT_MAX / 32; else (an infinite or NaN x, or x near FLT_MAX) inf - inf is NaN
      if (!(ax < 1e37f)) {
        exact_group(x + m * K, w, N, sg, zg, g, gs, o);
      } else if (zg) {
        for (int64_t n = 0; n < N; ++n) o[n] += sg[n] * ((a[n] - z8) - __builtin_roundevenf(zg[n]) * xs);
      } else {
        for (int64_t n = 0; n < N; ++n) o[n] += sg[n] * (a[n] - z8);
      }
    }
  }
}

// Runs fn(t) for every part t in 0..parts-1 and returns when all have finished. The parts go
// to whichever thread claims them first: this one and the tasks it schedules on XLA's
// intra-op thread pool. This thread claims every part no task has started, so it never waits
// for a task that has not started: XLA runs independent ops at once (two projections of one
// input), and two kernels each waiting on the pool for a task the other kernel's thread was
// to run deadlocked the pool. A task that starts after the last part is claimed returns at
// once; the state it reads is shared, so it outlives this call.
template <typename F>
void parallel(ffi::ThreadPool& pool, int64_t parts, const F& fn) {
  if (parts <= 1) {
    if (parts == 1) fn(0);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  const F* f = &fn;  // called only for a claimed part, which this call waits for
  auto work = [st, f, parts] {
    for (int64_t t; (t = st->next.fetch_add(1)) < parts;) {
      (*f)(t);
      if (st->done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  // a task runs parts until none is left: one per pool thread at most
  const int64_t tasks = std::min<int64_t>(parts - 1, std::max<int64_t>(1, pool.num_threads()));
  for (int64_t t = 0; t < tasks; ++t) {
    auto task = work;  // Schedule takes its task by value
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == parts; });
}

// How many parts a kernel's work is split into: up to kMaxParts, each at least
// kMinPartBytes of codes, from the shape alone. Each part past the first sums into a buffer
// of its own, added in order, so the partition decides the order of the float additions:
// from the shape alone, a compiled executable (a persistent compilation cache's, a
// serialized one) gives the same bits on a machine of any thread count. XLA runs
// independent ops at once (a layer's projections of one input), so a thread may be busy
// elsewhere when a call starts: with several parts per thread the others claim its share
// (parallel() hands parts to whoever is free); the partial buffers, zeroed and added
// serially, are the cost of more. The 100M decoder's batch-1 step (benchmarks/decode.py,
// 2-core AVX-512 EPYC, two runs each): w8 10.2-10.5 ms with 8 parts against 11.3-12.8
// with one part per thread of at least 128 KiB, w4 g128 9.3-9.6 against 9.7-10.9. 8 parts
// are what 2 threads took before the count stopped following the thread count: a machine
// of more threads runs at most 8 on one op (others run independent ops).
constexpr int64_t kMaxParts = 8, kMinPartBytes = 32 << 10;

int64_t part_count(ffi::ThreadPool&, int64_t units, int64_t bytes) {
  return std::max<int64_t>(1, std::min({kMaxParts, units, bytes / kMinPartBytes}));
}

// The layer of L stacked ones that the (scalar) layer operand picks, clamped to 0..L-1.
int64_t pick(ffi::Buffer<ffi::S32>& layer, int64_t L) {
  return std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
}

ffi::Error GroupedGemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zp,
                       ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> out, int64_t group_size) {
  const auto xd = x.dimensions(), wd = codes.dimensions(), sd = scale.dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || sd.size() != r || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "jqt_grouped_gemv: x must be 2-D, codes and scale 2-D (or 3-D, stacked layers), "
        "layer a scalar");
  const int64_t L = r == 3 ? wd[0] : 1, M = xd[0], K = xd[1], N = wd[r - 1];
  // one row of scales: per output channel, group_size then only splits K into the parts
  // the threads share (each part's sums scaled by the same scales)
  const bool per_channel = sd[r - 2] == 1;
  if (group_size <= 0 || group_size % 2 || K % group_size || wd[r - 2] * 2 != K ||
      (sd[r - 2] != K / group_size && !per_channel) || sd[r - 1] != N || (r == 3 && sd[0] != L) || L < 1 ||
      (zp.element_count() && zp.element_count() != scale.element_count()) ||
      (table.element_count() != 0 && table.element_count() != 16) ||
      (table.element_count() && zp.element_count()))
    return ffi::Error::InvalidArgument("jqt_grouped_gemv: operand shapes do not match");
  const int64_t G = K / group_size, l = pick(layer, L);
  const float* xp = x.typed_data();
  const uint8_t* wp = codes.typed_data() + l * (K / 2) * N;
  const int64_t SG = per_channel ? 1 : G;  // rows of scales per layer
  const float* sp = scale.typed_data() + l * SG * N;
  const float* zpp = zp.element_count() ? zp.typed_data() + l * SG * N : nullptr;
  const float* tp = table.element_count() ? table.typed_data() : nullptr;
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  // The groups (rows of K) split over XLA's intra-op threads, each part a contiguous run of
  // the codes read front to back (part_count); the parts' sums added. A row with a group
  // that takes exact_group runs in one part, so that its sum is one running sum in K order.
  const int64_t parts = huge_group(xp, M, K, group_size, 1e37f)
      ? 1 : part_count(pool, G, static_cast<int64_t>(codes.element_count() / L));
  std::vector<std::vector<float>> partial(static_cast<size_t>(parts - 1));
  for (auto& p : partial) p.resize(static_cast<size_t>(M * N));
  parallel(pool, parts, [&](int64_t t) {
    groups(xp, M, K, wp, N, sp, zpp, tp, group_size, t ? partial[t - 1].data() : op,
           G * t / parts, G * (t + 1) / parts, per_channel);
  });
  for (const auto& p : partial)
    for (int64_t i = 0; i < M * N; ++i) op[i] += p[i];
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------
// int8 weights with one scale (and zero point) per output channel, packed (N, K):
//   out[m, n] = scale[n] * sum_k x[m, k] * (code[n, k] - round(zp[n]))
// Each thread reads a contiguous block of the weight's rows front to back; each row's codes
// are widened to float32 and multiplied into float32 sums (AVX2 + FMA).

float channel_dot_scalar(const float* x, const int8_t* row, int64_t k0, int64_t K) {
  float s = 0.f;
  for (int64_t k = k0; k < K; ++k) s += x[k] * float(row[k]);
  return s;
}

#ifdef JQT_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

template <int M>
__attribute__((target("avx2,fma"))) void channel_rows_avx2(const float* __restrict x, int64_t K,
                                                           const int8_t* __restrict w, int64_t n0,
                                                           int64_t n1, float* __restrict dots,
                                                           int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m256 a[M][2];
    for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k + 2048), _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int m = 0; m < M; ++m) {
        a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), f0, a[m][0]);
        a[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), f1, a[m][1]);
      }
    }
    for (int m = 0; m < M; ++m)
      dots[m * N + n] = hsum(_mm256_add_ps(a[m][0], a[m][1])) + channel_dot_scalar(x + m * K, row, k, K);
  }
}
#endif

// dots[m][n] = sum_k x[m, k] * code[n, k] for the rows n0..n1 of the codes.
void channel_rows(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t n0, int64_t n1,
                  float* dots, int64_t N) {
  row_tiles(M, [&](int64_t m0, auto tile) {
    constexpr int mm = decltype(tile)::value;
    const float* xm = x + m0 * K;
    float* dm = dots + m0 * N;
#ifdef JQT_X86
    if (has_avx2()) return channel_rows_avx2<mm>(xm, K, w, n0, n1, dm, N);
#endif
    for (int m = 0; m < mm; ++m)
      for (int64_t n = n0; n < n1; ++n) dm[m * N + n] = channel_dot_scalar(xm + m * K, w + n * K, 0, K);
  });
}



// ---------------------------------------------------------------------------------------
// "jqt_channel_gemv_kn": the same op with the int8 codes packed (K, N) (w8 weight-only where
// XLA's float matmul, at many rows, reads a (K, N) weight faster than an (N, K) one):
//   out[m, n] = scale[n] * (sum_k x[m, k] * code[k, n] - round(zp[n]) * sum_k x[m, k])
// Each thread reads a contiguous block of K's rows front to back, a few rows at a time, and
// adds their codes (widened to float32) times x into float32 sums over the whole of N; the
// threads' sums are added. With group scales (G rows of scales per layer, w8 / w8a8 with
// group_size) each group's sums are scaled by its row first (grouped_kn, below).
//
// "jqt_fp8_gemv_kn": the same with fp8 codes (float8_e4m3fn or float8_e5m2, one scale per
// output channel, no zero point: the fp8 weights of jqt.recipes.fp8 as the CPU table packs
// them). A code's bits are shifted into a float16 and converted (F16C): e4m3fn's bias is 7
// against float16's 15, so its float16 is the value / 256; e5m2 is a float16's top byte (up
// to 57344, which times an activation above about 6e33 overflows float32), summed in units
// of 2^-15. Both factors are taken into the scale (numerics.FP8_BITS_UNIT), so the codes
// are at most 1.75 (448 / 2^8, 57344 / 2^15) and the scale times the factor at most 0.57x
// the weight's largest magnitude; e4m3fn's NaN (0x7F / 0xFF) is made a float16 NaN. The
// products are those of XLA's formulation, which decodes the same bits to the same float32
// units: e5m2's 2^-15 is taken from x (a copy, exact where no x but 0 is below 2^-111:
// x 2^-15 code rounds the same number as x (code 2^-15)), else from each code (kE5M2Units:
// a multiply per 8 codes, 10-25% of the kernel's time at one row on one thread).
enum class Codes { kInt8, kE4M3, kE5M2, kE5M2Units };

float half_to_float(uint32_t h) {
  const uint32_t e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(float(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp(float(m | 1024), int(e) - 25);
  return (h & 0x8000) ? -v : v;
}

// A code's value (e4m3fn: / 256, kE5M2Units: / 32768), as the vector loads below decode it.
template <Codes C>
float code_value(uint8_t u) {
  if constexpr (C == Codes::kInt8) return float(static_cast<int8_t>(u));
  if constexpr (C == Codes::kE5M2) return half_to_float(uint32_t(u) << 8);
  if constexpr (C == Codes::kE5M2Units) return half_to_float(uint32_t(u) << 8) * 0x1p-15f;
  if ((u & 0x7F) == 0x7F) return NAN;
  return half_to_float(((u & 0x80u) << 8) | ((u & 0x7Fu) << 7));
}

template <Codes C>
void channel_kn_scalar(const float* x, int64_t K, int M, const uint8_t* w, int64_t N,
                       int64_t k0, int64_t k1, int64_t n0, float* acc) {
  for (int64_t k = k0; k < k1; ++k)
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < N; ++n) acc[m * N + n] += x[m * K + k] * code_value<C>(w[k * N + n]);
}

#ifdef JQT_X86
// 16 codes from p as float32: f the first 8, g the next 8.
template <Codes C>
__attribute__((target("avx2,fma,f16c"))) inline void load16(const uint8_t* p, __m256& f, __m256& g) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (C == Codes::kInt8) {
    f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    g = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else {
    const __m256i u = _mm256_cvtepu8_epi16(b);
    __m256i h;
    if constexpr (C == Codes::kE5M2 || C == Codes::kE5M2Units) {
      h = _mm256_slli_epi16(u, 8);
    } else {
      const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi16(0x7F));
      h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                          _mm256_slli_epi16(mag, 7));
      h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00),
                             _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)));
    }
    f = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    g = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    if constexpr (C == Codes::kE5M2Units) {  // in units of 2^-15 (exact: float32 has the range)
      f = _mm256_mul_ps(f, _mm256_set1_ps(0x1p-15f));
      g = _mm256_mul_ps(g, _mm256_set1_ps(0x1p-15f));
    }
  }
}

// The columns n..n+15 of R rows of K from rows (row r's x values broadcast in xr[r]) added
// into the sums: acc[m][n + j] = fma(x[r], code[r][n + j], ...) for r = 0..R-1 in order.
template <int M, Codes C, int R>
__attribute__((target("avx2,fma,f16c"))) inline void kn_step16(const uint8_t* __restrict rows,
                                                               int64_t N, int64_t n,
                                                               const __m256 (&xr)[R][M],
                                                               float* __restrict acc) {
  __m256 f[R], g[R];
  for (int r = 0; r < R; ++r) load16<C>(rows + r * N + n, f[r], g[r]);
  for (int m = 0; m < M; ++m) {
    float* a = acc + m * N + n;
    __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
    for (int r = 0; r < R; ++r) {
      a0 = _mm256_fmadd_ps(xr[r][m], f[r], a0);
      a1 = _mm256_fmadd_ps(xr[r][m], g[r], a1);
    }
    _mm256_storeu_ps(a, a0);
    _mm256_storeu_ps(a + 8, a1);
  }
}

// Four rows of K per pass over the sums, which are read and written once per four rows of
// codes (two rows per pass ran the 100M decoder's step slower than jqt_channel_gemv).
template <int M, Codes C>
__attribute__((target("avx2,fma,f16c"))) void channel_kn_avx2(const float* __restrict x, int64_t K,
                                                              const uint8_t* __restrict w, int64_t N,
                                                              int64_t k0, int64_t k1,
                                                              float* __restrict acc) {
  constexpr int R = 4;
  int64_t k = k0;
  for (; k + R <= k1; k += R) {
    const uint8_t* rows = w + k * N;
    __m256 xr[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) xr[r][m] = _mm256_set1_ps(x[m * K + k + r]);
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      if ((n & 63) == 0)  // the same columns of the next R rows
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(rows + (R + r) * N + n), _MM_HINT_T0);
      kn_step16<M, C, R>(rows, N, n, xr, acc);
    }
    channel_kn_scalar<C>(x, K, M, w, N, k, k + R, n, acc);
  }
  channel_kn_scalar<C>(x, K, M, w, N, k, k1, 0, acc);
}

// 32 codes from p as float32 (AVX-512): f the first 16, g the next 16, as load16 decodes them.
template <Codes C>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void load32(const uint8_t* p, __m512& f, __m512& g) {
  if constexpr (C == Codes::kInt8) {
    f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    g = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  } else {
    const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i h;
    if constexpr (C == Codes::kE5M2 || C == Codes::kE5M2Units) {
      h = _mm512_slli_epi16(u, 8);
    } else {
      const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi16(0x7F));
      h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x80)), 8),
                          _mm512_slli_epi16(mag, 7));
      h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)),
                                _mm512_set1_epi16(0x7E00));
    }
    f = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    g = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    if constexpr (C == Codes::kE5M2Units) {
      f = _mm512_mul_ps(f, _mm512_set1_ps(0x1p-15f));
      g = _mm512_mul_ps(g, _mm512_set1_ps(0x1p-15f));
    }
  }
}

// channel_kn_avx2 at 32 columns per step: each column's fused multiply-adds in the same order.
// (A copy of its loop at another vector width on purpose: a function's target ISA cannot be a
// template parameter, and the two must stay operation for operation the same.)
template <int M, Codes C>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void channel_kn_avx512(
    const float* __restrict x, int64_t K, const uint8_t* __restrict w, int64_t N, int64_t k0,
    int64_t k1, float* __restrict acc) {
  constexpr int R = 4;
  int64_t k = k0;
  for (; k + R <= k1; k += R) {
    const uint8_t* rows = w + k * N;
    __m512 xr[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) xr[r][m] = _mm512_set1_ps(x[m * K + k + r]);
    int64_t n = 0;
    for (; n + 32 <= N; n += 32) {
      if ((n & 63) == 0)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(rows + (R + r) * N + n), _MM_HINT_T0);
      __m512 f[R], g[R];
      for (int r = 0; r < R; ++r) load32<C>(rows + r * N + n, f[r], g[r]);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * N + n;
        __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + 16);
        for (int r = 0; r < R; ++r) {
          a0 = _mm512_fmadd_ps(xr[r][m], f[r], a0);
          a1 = _mm512_fmadd_ps(xr[r][m], g[r], a1);
        }
        _mm512_storeu_ps(a, a0);
        _mm512_storeu_ps(a + 16, a1);
      }
    }
    if (n + 16 <= N) {  // 16 more columns as the AVX2 loop takes them (fused; the rest is not)
      __m256 xr8[R][M];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) xr8[r][m] = _mm256_set1_ps(x[m * K + k + r]);
      kn_step16<M, C, R>(rows, N, n, xr8, acc);
      n += 16;
    }
    channel_kn_scalar<C>(x, K, M, w, N, k, k + R, n, acc);
  }
  channel_kn_scalar<C>(x, K, M, w, N, k, k1, 0, acc);
}
#endif

// acc[m][0:N] += sum over K's rows k0..k1 of x[m, k] * code[k, 0:N], every row of x.
template <Codes C>
void channel_kn_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                     int64_t k0, int64_t k1, float* acc) {
  row_tiles(M, [&](int64_t m0, auto tile) {
    constexpr int mm = decltype(tile)::value;
#ifdef JQT_X86
    if (has_avx512()) return channel_kn_avx512<mm, C>(x + m0 * K, K, w, N, k0, k1, acc + m0 * N);
    if (has_avx2()) return channel_kn_avx2<mm, C>(x + m0 * K, K, w, N, k0, k1, acc + m0 * N);
#endif
    channel_kn_scalar<C>(x + m0 * K, K, mm, w, N, k0, k1, 0, acc + m0 * N);
  });
}

// int8 codes packed (K, N) with G groups of K / G rows along K, each with its row of scales
// (and zero points):
//   out[m, n] = sum_g scale[g, n] * (sum_{k in g} x[m, k] * code[k, n] - round(zp[g, n]) * sum_{k in g} x[m, k])
// The groups split over XLA's intra-op threads (part_count), each part a contiguous run of
// the codes read front to back; each group's sums (channel_kn_rows) scaled into the part's
// outputs, the parts' outputs added. A row whose group's sums could overflow (sum |x| of
// 1e36 or more: x times codes up to 128, and the zero point's term; an infinite or NaN x)
// takes that group as x times the decoded weight, (code - round(zp)) * scale, in float32:
// what the XLA formulation computes.
template <Codes C>
void grouped_kn(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* w,
                int64_t N, const float* scale, const float* zp, int64_t G, float unit, float* out) {
  const int64_t gs = K / G;
  // (one part where a group takes the decoded weight: one running sum in K order, which
  // stays at an infinity as a float dot's does; two parts' +inf and -inf gave NaN)
  const int64_t parts = huge_group(x, M, K, gs, 1e36f) ? 1 : part_count(pool, G, N * K);
  std::vector<std::vector<float>> partial(static_cast<size_t>(parts - 1));
  for (auto& p : partial) p.resize(static_cast<size_t>(M * N));
  parallel(pool, parts, [&](int64_t t) {
    float* o = t ? partial[t - 1].data() : out;
    std::fill(o, o + M * N, 0.f);
    std::vector<float> acc(static_cast<size_t>(M * N));
    for (int64_t g = G * t / parts; g < G * (t + 1) / parts; ++g) {
      std::fill(acc.begin(), acc.end(), 0.f);
      channel_kn_rows<C>(x, M, K, w, N, g * gs, (g + 1) * gs, acc.data());
      const float* sg = scale + g * N;
      const float* zg = zp ? zp + g * N : nullptr;
      for (int64_t m = 0; m < M; ++m) {
        float xs = 0.f, ax = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) xs += x[m * K + k], ax += std::fabs(x[m * K + k]);
        float* om = o + m * N;
        if (!(ax < 1e36f)) {  // the decoded weight (int8 codes: the only ones with groups here)
          for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
            const int8_t* row = reinterpret_cast<const int8_t*>(w + k * N);
            const float xk = x[m * K + k];
            for (int64_t n = 0; n < N; ++n)
              om[n] += xk * ((float(row[n]) - (zg ? __builtin_roundevenf(zg[n]) : 0.f)) * sg[n] * unit);
          }
          continue;
        }
        const float* a = acc.data() + m * N;
        for (int64_t n = 0; n < N; ++n)
          om[n] += sg[n] * unit * (zg ? a[n] - __builtin_roundevenf(zg[n]) * xs : a[n]);
      }
    }
  });
  for (const auto& p : partial)
    for (int64_t i = 0; i < M * N; ++i) out[i] += p[i];
}

// The int8 and fp8 kernels: codes packed (N, K) (KN false, int8 only: each thread a block of
// the codes' rows, the outputs) or (K, N) (KN true: each thread a block of K's rows, their
// sums added). ``unit``: what the codes' decoded values are multiplied by (e4m3fn: 256,
// e5m2: 32768), taken into the scale before it multiplies the sums.
template <bool KN, Codes C>
ffi::Error ChannelGemvT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, const uint8_t* codes,
                        ffi::Span<const int64_t> wd, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> zp, ffi::Buffer<ffi::F32> table,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                        const std::string& name, float unit) {
  const auto xd = x.dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        name + ": x must be 2-D, codes 2-D (or 3-D, stacked layers), layer a scalar");
  const int64_t L = r == 3 ? wd[0] : 1, M = xd[0], K = xd[1], N = wd[KN ? r - 1 : r - 2];
  // G rows of scales per layer: 1 (per output channel), or K / G rows of K per group ((K, N)
  // int8 codes only: w8 / w8a8 with group_size)
  const int64_t G = L >= 1 && N > 0 ? int64_t(scale.element_count()) / (L * N) : 1;
  // table: the operand list the grouped kernel has, empty here (int or fp8 codes only)
  if (L < 1 || wd[KN ? r - 2 : r - 1] != K || G < 1 || scale.element_count() != L * G * N ||
      (G > 1 && (!KN || C != Codes::kInt8 || K % G)) ||
      (zp.element_count() && zp.element_count() != L * G * N) || table.element_count())
    return ffi::Error::InvalidArgument(name + ": operand shapes do not match");
  const int64_t l = pick(layer, L);
  const float* xp = x.typed_data();
  std::vector<float> x15;  // kE5M2: x in units of 2^-15 (exact), the codes in their own
  if constexpr (C == Codes::kE5M2) {
    x15.assign(xp, xp + M * K);
    for (float& v : x15) v *= 0x1p-15f;
    xp = x15.data();
  }
  const uint8_t* wp = codes + l * N * K;
  const float* sp = scale.typed_data() + l * G * N;
  const float* zpp = zp.element_count() ? zp.typed_data() + l * G * N : nullptr;
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (KN && G > 1) {  // groups: each group's sums scaled by its scales, as jqt_grouped_gemv does
    grouped_kn<C>(pool, xp, M, K, wp, N, sp, zpp, G, unit, op);
    return ffi::Error::Success();
  }
  // The codes split over XLA's intra-op threads (part_count).
  const int64_t parts = part_count(pool, KN ? K / 2 : N, N * K);
  if constexpr (KN) {
    std::fill(op, op + M * N, 0.f);
    std::vector<std::vector<float>> partial(static_cast<size_t>(parts - 1));
    for (auto& p : partial) p.assign(static_cast<size_t>(M * N), 0.f);
    parallel(pool, parts, [&](int64_t t) {
      // an even number of rows per part, the last part the rest
      const int64_t a = (K / 2) * t / parts * 2, b = t + 1 == parts ? K : (K / 2) * (t + 1) / parts * 2;
      channel_kn_rows<C>(xp, M, K, wp, N, a, b, t ? partial[t - 1].data() : op);
    });
    for (const auto& p : partial)
      for (int64_t i = 0; i < M * N; ++i) op[i] += p[i];
  } else {
    const int8_t* w8 = reinterpret_cast<const int8_t*>(wp);
    parallel(pool, parts, [&](int64_t t) {
      channel_rows(xp, M, K, w8, N * t / parts, N * (t + 1) / parts, op, N);
    });
  }
  for (int64_t m = 0; m < M; ++m) {
    float xs = 0.f;
    if (zpp)
      for (int64_t k = 0; k < K; ++k) xs += xp[m * K + k];
    float* o = op + m * N;
    for (int64_t n = 0; n < N; ++n)
      o[n] = sp[n] * unit * (zpp ? o[n] - __builtin_roundevenf(zpp[n]) * xs : o[n]);
  }
  return ffi::Error::Success();
}

ffi::Error ChannelGemv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zp,
                       ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> out) {
  return ChannelGemvT<false, Codes::kInt8>(pool, x, reinterpret_cast<const uint8_t*>(codes.typed_data()),
                                           codes.dimensions(), scale, zp, table, layer, out,
                                           "jqt_channel_gemv", 1.f);
}

ffi::Error ChannelGemvKn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                         ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zp,
                         ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                         ffi::ResultBuffer<ffi::F32> out) {
  return ChannelGemvT<true, Codes::kInt8>(pool, x, reinterpret_cast<const uint8_t*>(codes.typed_data()),
                                          codes.dimensions(), scale, zp, table, layer, out,
                                          "jqt_channel_gemv_kn", 1.f);
}

ffi::Error Fp8GemvKn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zp,
                     ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto* w = static_cast<const uint8_t*>(codes.untyped_data());
  const std::string name = "jqt_fp8_gemv_kn";
  if (zp.element_count())
    return ffi::Error::InvalidArgument(name + ": fp8 codes take no zero point");
  switch (codes.element_type()) {
    case ffi::DataType::F8E4M3FN:
      return ChannelGemvT<true, Codes::kE4M3>(pool, x, w, codes.dimensions(), scale, zp, table,
                                              layer, out, name, 256.f);
    case ffi::DataType::F8E5M2: {
      // 2^-15 from x where x 2^-15 is exact (no x but 0 below 2^-111), else from the codes
      const float* xp = x.typed_data();
      bool tiny = false;
      for (int64_t i = 0, n = int64_t(x.element_count()); i < n && !tiny; ++i) {
        const float a = std::fabs(xp[i]);
        tiny = a != 0.f && a < 0x1p-111f;
      }
      if (tiny)
        return ChannelGemvT<true, Codes::kE5M2Units>(pool, x, w, codes.dimensions(), scale, zp,
                                                     table, layer, out, name, 32768.f);
      return ChannelGemvT<true, Codes::kE5M2>(pool, x, w, codes.dimensions(), scale, zp, table,
                                              layer, out, name, 32768.f);
    }
    default:
      return ffi::Error::InvalidArgument(name + ": codes must be float8_e4m3fn or float8_e5m2");
  }
}

// ---------------------------------------------------------------------------------------
// "jqt_nibble_decode": the whole weight decoded to float32 for XLA's matmul at many rows,
// the codes as jqt_grouped_gemv reads them (two 4-bit codes per byte along K, packed (K, N);
// group scales and zero points, or one row of them for codes with one scale per output
// channel; NF4's 16-entry table or none):
//   out[k, n] = (value(code[k, n]) - round(zp[g, n])) * scale[g, n],  g = k / group_size
// with value the code itself or table[code + 8]: the XLA formulation's float32 operations,
// in the same order, so the same bits. XLA:CPU decodes NF4 by a tree of 15 selects per code;
// here the table's two halves sit in two registers and a code is one permute of each and a
// blend (AVX-512: the whole table in one register, one permute). Rows of K are split over
// XLA's intra-op threads.

// Byte row r of the codes, its group's scales and zero points (null: none), and the two
// rows of K it decodes into (even, odd).
struct DecodeRow {
  const uint8_t* row;
  const float* s;
  const float* z;
  float* even;
  float* odd;
};

inline DecodeRow decode_row(const uint8_t* w, int64_t N, int64_t r, const float* scale,
                            const float* zp, int64_t R, bool per_channel, float* out) {
  const int64_t g = per_channel ? 0 : r / R;  // R: byte rows per group
  return {w + r * N, scale + g * N, zp ? zp + g * N : nullptr, out + 2 * r * N,
          out + (2 * r + 1) * N};
}

// The columns n0..N-1 of byte row ``row`` decoded (scalar): its even row of K into even, its
// odd row into odd; s and z the row's group's scales and zero points (z null: none), table
// NF4's (null: int codes). The vector loops below take the same operations per code.
inline void decode_columns(const uint8_t* row, int64_t n0, int64_t N, const float* s,
                           const float* z, const float* table, float* even, float* odd) {
  for (int64_t n = n0; n < N; ++n) {
    const unsigned u = row[n] ^ 0x88;
    float lo = table ? table[u & 15] : float(int(u & 15) - 8);
    float hi = table ? table[u >> 4] : float(int(u >> 4) - 8);
    if (z) {
      const float zr = __builtin_roundevenf(z[n]);
      lo -= zr;
      hi -= zr;
    }
    even[n] = lo * s[n];
    odd[n] = hi * s[n];
  }
}

#ifdef JQT_X86
template <bool LUT>
__attribute__((target("avx2,fma"))) inline __m256 code_values(__m256i u, __m256 t0, __m256 t1) {
  if (LUT) {  // u = code + 8: the entry of the half that bit 3 picks
    const __m256 a = _mm256_permutevar8x32_ps(t0, u), b = _mm256_permutevar8x32_ps(t1, u);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));
  }
  return _mm256_sub_ps(_mm256_cvtepi32_ps(u), _mm256_set1_ps(8.f));  // the code, exactly
}

template <bool LUT, bool ZP>
__attribute__((target("avx2,fma"))) void decode_avx2(const uint8_t* __restrict w, int64_t N,
                                                     int64_t r0, int64_t r1, const float* scale,
                                                     const float* zp, const float* table,
                                                     int64_t R, bool per_channel,
                                                     float* __restrict out) {
  const __m256 t0 = LUT ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
  const __m256 t1 = LUT ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));
  for (int64_t r = r0; r < r1; ++r) {
    const auto [row, s, z, even, odd] = decode_row(w, N, r, scale, zp, R, per_channel, out);
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
      const __m256i u = _mm256_cvtepu8_epi32(
          _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + n)), flip));
      __m256 lo = code_values<LUT>(_mm256_and_si256(u, low), t0, t1);
      __m256 hi = code_values<LUT>(_mm256_srli_epi32(u, 4), t0, t1);
      if (ZP) {
        const __m256 zr = _mm256_round_ps(_mm256_loadu_ps(z + n), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        lo = _mm256_sub_ps(lo, zr);
        hi = _mm256_sub_ps(hi, zr);
      }
      const __m256 sv = _mm256_loadu_ps(s + n);
      _mm256_storeu_ps(even + n, _mm256_mul_ps(lo, sv));
      _mm256_storeu_ps(odd + n, _mm256_mul_ps(hi, sv));
    }
    decode_columns(row, n, N, s, z, table, even, odd);
  }
}
#endif

#ifdef JQT_X86
// decode_avx2 at 16 columns per step: each code's operations the same, in the same order.
template <bool LUT, bool ZP>
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void decode_avx512(
    const uint8_t* __restrict w, int64_t N, int64_t r0, int64_t r1, const float* scale,
    const float* zp, const float* table, int64_t R, bool per_channel, float* __restrict out) {
  const __m512 t = LUT ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88));
  for (int64_t r = r0; r < r1; ++r) {
    const auto [row, s, z, even, odd] = decode_row(w, N, r, scale, zp, R, per_channel, out);
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      const __m512i u = _mm512_cvtepu8_epi32(
          _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + n)), flip));
      const __m512i ul = _mm512_and_si512(u, low), uh = _mm512_srli_epi32(u, 4);
      __m512 lo, hi;
      if (LUT) {
        lo = _mm512_permutexvar_ps(ul, t);
        hi = _mm512_permutexvar_ps(uh, t);
      } else {  // the code, exactly
        lo = _mm512_sub_ps(_mm512_cvtepi32_ps(ul), _mm512_set1_ps(8.f));
        hi = _mm512_sub_ps(_mm512_cvtepi32_ps(uh), _mm512_set1_ps(8.f));
      }
      if (ZP) {
        const __m512 zr = _mm512_roundscale_ps(_mm512_loadu_ps(z + n), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        lo = _mm512_sub_ps(lo, zr);
        hi = _mm512_sub_ps(hi, zr);
      }
      const __m512 sv = _mm512_loadu_ps(s + n);
      _mm512_storeu_ps(even + n, _mm512_mul_ps(lo, sv));
      _mm512_storeu_ps(odd + n, _mm512_mul_ps(hi, sv));
    }
    decode_columns(row, n, N, s, z, table, even, odd);
  }
}
#endif

void decode_scalar(const uint8_t* w, int64_t N, int64_t r0, int64_t r1, const float* scale,
                   const float* zp, const float* table, int64_t R, bool per_channel, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const auto [row, s, z, even, odd] = decode_row(w, N, r, scale, zp, R, per_channel, out);
    decode_columns(row, 0, N, s, z, table, even, odd);
  }
}

// tie: the op's activation's first element (or empty), not read: the dependency that keeps
// XLA from decoding the weight before its op's input exists (numerics.after).
ffi::Error NibbleDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> zp, ffi::Buffer<ffi::F32> table,
                        ffi::Buffer<ffi::F32> tie, ffi::ResultBuffer<ffi::F32> out,
                        int64_t group_size) {
  const auto wd = codes.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || sd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("jqt_nibble_decode: codes, scale and out must be 2-D");
  const int64_t rows = wd[0], N = wd[1], K = 2 * rows;
  const bool per_channel = sd[0] == 1;
  if (group_size <= 0 || group_size % 2 || K % group_size || od[0] != K || od[1] != N ||
      (sd[0] != K / group_size && !per_channel) || sd[1] != N ||
      (zp.element_count() && zp.element_count() != scale.element_count()) ||
      (table.element_count() != 0 && table.element_count() != 16) ||
      (table.element_count() && zp.element_count()))
    return ffi::Error::InvalidArgument("jqt_nibble_decode: operand shapes do not match");
  const uint8_t* w = codes.typed_data();
  const float* sp = scale.typed_data();
  const float* zpp = zp.element_count() ? zp.typed_data() : nullptr;
  const float* tp = table.element_count() ? table.typed_data() : nullptr;
  float* op = out->typed_data();
  const int64_t R = group_size / 2;  // byte rows per group
  // at least 64 Ki codes per part
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (rows * N) >> 16));
  parallel(pool, parts, [&](int64_t t) {
    const int64_t r0 = rows * t / parts, r1 = rows * (t + 1) / parts;
#ifdef JQT_X86
    if (has_avx512()) {
      if (tp) return decode_avx512<true, false>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
      if (zpp) return decode_avx512<false, true>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
      return decode_avx512<false, false>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
    }
    if (has_avx2()) {
      if (tp) return decode_avx2<true, false>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
      if (zpp) return decode_avx2<false, true>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
      return decode_avx2<false, false>(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
    }
#endif
    decode_scalar(w, N, r0, r1, sp, zpp, tp, R, per_channel, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JqtGroupedGemv, GroupedGemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size"));

// The int8 kernels' operands: x, codes, scale, zero point, table (empty), layer.
#define JQT_CHANNEL_BINDING                         \
  ffi::Ffi::Bind()                                  \
      .Ctx<ffi::ThreadPool>()                       \
      .Arg<ffi::Buffer<ffi::F32>>()                 \
      .Arg<ffi::Buffer<ffi::S8>>()                  \
      .Arg<ffi::Buffer<ffi::F32>>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()                 \
      .Arg<ffi::Buffer<ffi::S32>>()                 \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JqtChannelGemv, ChannelGemv, JQT_CHANNEL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JqtChannelGemvKn, ChannelGemvKn, JQT_CHANNEL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JqtFp8GemvKn, Fp8GemvKn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JqtNibbleDecode, NibbleDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size"));

// 3: AVX-512 kernels where they exist, else AVX2; 2: AVX2 + FMA (+ F16C) kernels; 0: the
// portable scalar loop only (jqt does not use it then).
extern "C" int jqt_native_isa() {
#ifdef JQT_X86
  return has_avx512() ? 3 : has_avx2() ? 2 : 0;
#else
  return 0;
#endif
}
