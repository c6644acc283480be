// Fused small ops of a decode / verification step (M = 1..32 new tokens per row), AVX-512. The
// prefill (longer blocks) uses them too, between its large-M projections: the row ops are parallel
// over rows, and attend over (row, KV head) and, with fewer of those than threads, query blocks.
//
// Next to the weight-streaming matmuls of wo_gemm.cpp, a step of a small model spends several
// milliseconds in a few hundred tiny aten ops: RMSNorm (~8 ops), rotary embeddings (~10),
// the K/V cache write (index_put), the few-query attention (two tiny bmm calls and a softmax)
// and silu(gate) * up. Each function here does one of those groups in one call:
//
//   rms_norm(x, w, eps)              y = round(round(x * rsqrt(mean(x^2) + eps)) * w)
//   add_rms_norm(x, delta, w, eps)   x = round(x + delta) in place, then rms_norm(x)
//   silu_mul(gate_up)                round(round(silu(gate)) * up), gate = first half of each row
//   attend(qkv, cos, sin, positions, k_cache, v_cache, kv_len, H, KV)
//                                    rotate-half RoPE of q and k, K/V written into the cache at
//                                    the positions, then grouped-query attention of every query
//                                    over keys j < kv_len and j <= its position.
//   attend(..., ancestors)           a token tree: row b's m new tokens take slots positions[b, 0] + i
//                                    and query i sees, of them, only those whose bit is set in
//                                    ancestors[b, i] (its root path); keys before the first slot
//                                    stay visible. RoPE follows cos/sin, which the caller takes
//                                    at each node's depth. A node's output equals its root path's
//                                    as a chain, bit for bit (see attend_group).
//
// "round" is a rounding to the tensors' dtype (bf16, or nothing for fp32): the roundings the
// PyTorch reference (verispec/models/llama.py) makes between its ops are kept where they are
// cheap, so the fused path tracks it closely. Everything else accumulates in fp32. Attention
// scores stay fp32 (the reference rounds its bmm scores to bf16; SDPA, its prefill path, does
// not); softmax is fp32, its numerators are rounded to bf16 for P @ V in bf16 models (as the
// reference rounds its probabilities to v's dtype), and the output is normalised once at the end.
// K and V written into the cache equal the reference's bit for bit. See attend_group for the
// layout of the attention loops.
//
// The arithmetic for one row / one query never depends on how many rows or queries share the
// call nor on how the work is threaded: a query's sums run over d and over its own keys in a
// fixed order whatever vector lane it sits in, and padding (keys past a query's position, empty
// lanes) only ever adds exact zeros. Speculative verification compares rows verified alone and
// in batches bit for bit.
//
// As in wo_gemm.cpp, every AVX-512 function carries a target attribute (the library loads on any
// x86-64 CPU; Python only calls in when cpu_supported()), and parallel loops have grain sizes
// that keep the tiny work of a decode step on the calling thread.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifndef VS_NS
#define VS_NS verispec_wo_gemm
#endif

namespace VS_NS {
bool cpu_runs_kernels();  // wo_gemm.cpp: the one definition of a CPU these kernels run on
bool cpu_runs_avx2();    // wo_gemm.cpp: AVX2 and FMA
}

namespace {

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))

using bf16_t = uint16_t;  // raw bf16 bits

// Whether the AVX-512 ops run here (else the AVX2 ones, fp32 only; see the AVX2 section).
bool wide() {
  static const bool ok = VS_NS::cpu_runs_kernels();
  return ok;
}

void check_cpu(const torch::Tensor& x) {
  static const bool avx2 = VS_NS::cpu_runs_avx2();
  TORCH_CHECK(wide() || avx2, "verispec kernels: this CPU lacks AVX2");
  TORCH_CHECK(wide() || x.scalar_type() == torch::kFloat,
              "verispec kernels: the fused small ops take bf16 only with AVX-512 BF16; this CPU runs them in fp32");
}

inline __mmask16 mask16(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

// ---- element access: 16 values as fp32, whatever the storage --------------------------------

VS_AVX512 inline __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
VS_AVX512 inline __m512 load(const bf16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
VS_AVX512 inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
VS_AVX512 inline __m512 load(const bf16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
VS_AVX512 inline void store(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
VS_AVX512 inline void store(bf16_t* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
}

// Round to the storage type and back (round to nearest even for bf16; nothing for fp32, where the
// empty asm only keeps the compiler from fusing the product before it into a later add, so fp32
// results round each op as PyTorch's do).
VS_AVX512 inline __m512 round_to(__m512 v, const float*) {
  __asm__("" : "+v"(v));
  return v;
}
VS_AVX512 inline __m512 round_to(__m512 v, const bf16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
template <class T>
VS_AVX512 inline __m512 rnd(__m512 v) {
  return round_to(v, static_cast<const T*>(nullptr));
}

// exp(x), Cephes' single-precision polynomial (about 1 ulp): x clamped to [EXP_MIN, EXP_MAX],
// n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), exp(r) = 1 + r + r^2 P(r), times 2^n.
// +inf past ~88.72, and at least ~1.2e-38 (not 0) below -87.3: callers either mask those lanes or
// only add 1 to them.
constexpr float EXP_MAX = 88.73f, EXP_MIN = -87.33f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

VS_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX)), _mm512_set1_ps(EXP_MIN));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// ---- RMSNorm ----------------------------------------------------------------------------------

// Sum of squares of one row (fixed order: lane-wise over chunks of 16, then one reduction).
template <class T>
VS_AVX512 inline float sum_squares(const T* x, int64_t d) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    const __m512 v0 = load(x + c), v1 = load(x + c + 16);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; c < d; c += 16) {
    const __m512 v = load(x + c, mask16(d - c));
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

template <class T>
VS_AVX512 void norm_row(const T* x, const T* w, int64_t d, float eps, float ss, T* y) {
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = mask16(d - c);
    const __m512 v = rnd<T>(_mm512_mul_ps(load(x + c, k), inv));
    store(y + c, _mm512_mul_ps(v, load(w + c, k)), k);
  }
}

template <class T>
VS_AVX512 void rms_norm_range(const T* x, const T* w, int64_t r0, int64_t r1, int64_t d, float eps, T* y) {
  for (int64_t r = r0; r < r1; ++r) norm_row(x + r * d, w, d, eps, sum_squares(x + r * d, d), y + r * d);
}

template <class T>
VS_AVX512 void add_rms_norm_range(T* x, const T* delta, const T* w, int64_t r0, int64_t r1, int64_t d, float eps,
                                  T* y) {
  for (int64_t r = r0; r < r1; ++r) {
    T* xr = x + r * d;
    const T* dr = delta + r * d;
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 k = mask16(d - c);
      store(xr + c, _mm512_add_ps(load(xr + c, k), load(dr + c, k)), k);
    }
    norm_row(xr, w, d, eps, sum_squares(xr, d), y + r * d);
  }
}

// ---- silu(gate) * up ----------------------------------------------------------------------------

template <class T>
VS_AVX512 void silu_mul_range(const T* gu, int64_t r0, int64_t r1, int64_t f, T* y) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gu + r * 2 * f;
    const T* u = g + f;
    T* o = y + r * f;
    for (int64_t c = 0; c < f; c += 16) {
      const __mmask16 k = mask16(f - c);
      const __m512 gv = load(g + c, k);
      const __m512 s = rnd<T>(_mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
      store(o + c, _mm512_mul_ps(s, load(u + c, k)), k);
    }
  }
}

// Rows per task: at least ~64K values, so the tiny rows of a decode step stay on one thread.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, width)); }

// ---- attention ----------------------------------------------------------------------------------

// Rotate-half RoPE of one head (d values): out = x * cos + rotate_half(x) * sin, with the
// reference's roundings (each product, then the sum).
template <class T>
VS_AVX512 void rope_head(const T* x, const T* cos, const T* sin, int64_t d, T* out) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < half; c += 16) {
    const __mmask16 k = mask16(half - c);
    const __m512 x1 = load(x + c, k), x2 = load(x + half + c, k);
    const __m512 lo = _mm512_sub_ps(rnd<T>(_mm512_mul_ps(x1, load(cos + c, k))),
                                    rnd<T>(_mm512_mul_ps(x2, load(sin + c, k))));
    const __m512 hi = _mm512_add_ps(rnd<T>(_mm512_mul_ps(x2, load(cos + half + c, k))),
                                    rnd<T>(_mm512_mul_ps(x1, load(sin + half + c, k))));
    store(out + c, lo, k);
    store(out + half + c, hi, k);
  }
}

template <class T>
VS_AVX512 void copy_head(const T* x, int64_t d, T* out) {
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 k = mask16(d - c);
    if constexpr (sizeof(T) == 2) {
      _mm256_mask_storeu_epi16(out + c, k, _mm256_maskz_loadu_epi16(k, x + c));
    } else {
      _mm512_mask_storeu_ps(out + c, k, _mm512_maskz_loadu_ps(k, x + c));
    }
  }
}

// Attention of one (row, KV head): its G query heads at the row's m new positions, in blocks of 8
// queries that sit in vector lanes, two lanes per query.
//
// Scores: the block is transposed once into `qt` so that lane 2q + e holds query q's words (bf16
// pairs, or fp32 values) of index = e mod 2; broadcasting 64 bits of a key (two words) against it
// accumulates, per lane, the even or the odd words of q . k (vdpbf16ps or fp32 FMAs) in order of
// d. Adding each query's two lanes gives its score: no transposes or horizontal sums over d, and
// the arithmetic of a query never depends on its lane, on the other queries or on their number.
// Softmax runs lane-wise over the keys (two keys per zmm).
// P @ V: output values in lanes, accumulated over the keys in order. bf16: the probabilities are
// rounded to bf16 (as the reference rounds its probs to v's dtype) and two keys at a time go
// through vdpbf16ps against V rows interleaved in pairs (unpacklo/hi_epi16), which permutes the
// output values within each chunk of 32 (undone at the end); fp32: FMAs, one key at a time.
constexpr int64_t QB = 8;   // queries per block (16 lanes)
constexpr int64_t KB = 16;  // keys per pass of the score loop (independent accumulators)
constexpr int64_t JT = 64;  // keys per tile of the P @ V pass (a tile of V stays in L1)
constexpr int64_t PF = 32;  // keys ahead to prefetch (the cache is cold after the weights streamed by)

// Word of the transposed query block: a bf16 pair or an fp32 value.
template <class T>
struct Attn;
template <>
struct Attn<bf16_t> {
  using Word = uint32_t;
  static constexpr int64_t per_word = 2;
};
template <>
struct Attn<float> {
  using Word = float;
  static constexpr int64_t per_word = 1;
};

// 64 bits of a key (two bf16 pairs or two fp32 values), whatever the alignment.
inline int64_t bits64(const void* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Lanes 2q, 2q + 1 of a (key t) and of b (key t + 1) summed -> [key t: 8 queries | key t + 1: 8].
VS_AVX512 inline __m512 pair_lanes(__m512 a, __m512 b) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// out[t * 8 + q] = scale * (q . k[t]) for KB keys (key t at k[t]), d values each.
VS_AVX512 inline void scores_block(const uint32_t* qt, const bf16_t* const* k, int64_t d, __m512 scale, float* out) {
  __m512 acc[KB];
  for (int t = 0; t < KB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d / 4; ++c) {
    const __m512i qv = _mm512_loadu_si512(qt + c * 16);
#pragma GCC unroll 16
    for (int t = 0; t < KB; ++t) {
      const __m512i kv = _mm512_set1_epi64(bits64(k[t] + 4 * c));
      acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)qv, (__m512bh)kv);
    }
  }
  for (int t = 0; t < KB; t += 2) _mm512_storeu_ps(out + t * QB, _mm512_mul_ps(pair_lanes(acc[t], acc[t + 1]), scale));
}

VS_AVX512 inline void scores_block(const float* qt, const float* const* k, int64_t d, __m512 scale, float* out) {
  __m512 acc[KB];
  for (int t = 0; t < KB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d / 2; ++c) {
    const __m512 qv = _mm512_loadu_ps(qt + c * 16);
#pragma GCC unroll 16
    for (int t = 0; t < KB; ++t) {
      const __m512 kv = _mm512_castsi512_ps(_mm512_set1_epi64(bits64(k[t] + 2 * c)));
      acc[t] = _mm512_fmadd_ps(qv, kv, acc[t]);
    }
  }
  for (int t = 0; t < KB; t += 2) _mm512_storeu_ps(out + t * QB, _mm512_mul_ps(pair_lanes(acc[t], acc[t + 1]), scale));
}

// bf16 P @ V for NQ queries, keys [j0, j1) (j0 even; n keys in all) and the chunk of 32 output values
// at c0: acc[q * ld + c0 ..][32] (permuted) += sum over j of p[j][q] * v[j][c0 ..].
// pp: the probabilities as bf16 pairs of consecutive keys, [key / 2][8 queries].
// Key: the cache row of key j. Contiguous for a chain; a tree node's keys vbase + t are its root path's rows
// (PathKeys). A template parameter, so the chain's loops compile as if there were no map.
struct Contiguous {
  inline int64_t operator()(int64_t j) const { return j; }
};
struct PathKeys {
  const int64_t* path;
  int64_t vbase;
  inline int64_t operator()(int64_t j) const { return j >= vbase ? path[j - vbase] : j; }
};

template <int NQ, class Key>
VS_AVX512 void pv_bf16(const uint32_t* pp, const bf16_t* v, int64_t ldv, int64_t n, int64_t j0, int64_t j1,
                       int64_t c0, int64_t d, float* acc, int64_t ld, Key key) {
  const __mmask32 m = d - c0 >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>(0xFFFFu);
  __m512 lo[NQ], hi[NQ];
  for (int q = 0; q < NQ; ++q) {
    lo[q] = _mm512_loadu_ps(acc + q * ld + c0);
    hi[q] = _mm512_loadu_ps(acc + q * ld + c0 + 16);
  }
  for (int64_t j = j0; j < j1; j += 2) {
    const bf16_t* r0 = v + key(j) * ldv + c0;
    const bf16_t* r1 = v + key(j + 1 < n ? j + 1 : j) * ldv + c0;  // past the last key: its p is 0
    const __m512i a = _mm512_maskz_loadu_epi16(m, r0), b = _mm512_maskz_loadu_epi16(m, r1);
    const __m512i vl = _mm512_unpacklo_epi16(a, b), vh = _mm512_unpackhi_epi16(a, b);
    const uint32_t* pj = pp + (j / 2) * QB;
#pragma GCC unroll 8
    for (int q = 0; q < NQ; ++q) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pj[q]));
      lo[q] = _mm512_dpbf16_ps(lo[q], (__m512bh)vl, (__m512bh)p);
      hi[q] = _mm512_dpbf16_ps(hi[q], (__m512bh)vh, (__m512bh)p);
    }
  }
  for (int q = 0; q < NQ; ++q) {
    _mm512_storeu_ps(acc + q * ld + c0, lo[q]);
    _mm512_storeu_ps(acc + q * ld + c0 + 16, hi[q]);
  }
}

// fp32 P @ V for NQ queries, keys [j0, j1), output values [c0, c0 + 16 NC): acc[q * ld + ..] += p[j][q] v[j].
// p: the probabilities [key][8 queries].
template <int NQ, int NC, class Key>
VS_AVX512 void pv_fp32(const float* p, const float* v, int64_t ldv, int64_t j0, int64_t j1, int64_t c0, float* acc,
                       int64_t ld, Key key) {
  __m512 a[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) a[q][c] = _mm512_loadu_ps(acc + q * ld + c0 + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + key(j) * ldv + c0 + 16 * c);
    for (int q = 0; q < NQ; ++q) {
      const __m512 pj = _mm512_set1_ps(p[j * QB + q]);
      for (int c = 0; c < NC; ++c) a[q][c] = _mm512_fmadd_ps(pj, vv[c], a[q][c]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + q * ld + c0 + 16 * c, a[q][c]);
}

template <int NQ, class Key>
VS_AVX512 void pv_fp32_nc(int nc, const float* p, const float* v, int64_t ldv, int64_t j0, int64_t j1, int64_t c0,
                          float* acc, int64_t ld, Key key) {
  switch (nc) {
    case 1: pv_fp32<NQ, 1, Key>(p, v, ldv, j0, j1, c0, acc, ld, key); break;
    case 2: pv_fp32<NQ, 2, Key>(p, v, ldv, j0, j1, c0, acc, ld, key); break;
    case 3: pv_fp32<NQ, 3, Key>(p, v, ldv, j0, j1, c0, acc, ld, key); break;
    default: pv_fp32<NQ, 4, Key>(p, v, ldv, j0, j1, c0, acc, ld, key); break;
  }
}

// The P @ V pass of one block of nq queries over keys [0, n): into acc [nq][ld] (zeroed here).
template <class Key>
VS_AVX512 void pv_pass(const float* p, const uint32_t* pp, const bf16_t* v, int64_t ldv, int64_t n, int64_t d,
                       int64_t nq, float* acc, int64_t ld, Key key) {
  (void)p;
  std::fill(acc, acc + nq * ld, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += JT) {
    const int64_t j1 = std::min(n, j0 + JT);
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
      switch (nq) {
        case 1: pv_bf16<1, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 2: pv_bf16<2, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 3: pv_bf16<3, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 4: pv_bf16<4, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 5: pv_bf16<5, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 6: pv_bf16<6, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        case 7: pv_bf16<7, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
        default: pv_bf16<8, Key>(pp, v, ldv, n, j0, j1, c0, d, acc, ld, key); break;
      }
    }
  }
}

template <class Key>
VS_AVX512 void pv_pass(const float* p, const uint32_t* pp, const float* v, int64_t ldv, int64_t n, int64_t d,
                       int64_t nq, float* acc, int64_t ld, Key key) {
  (void)pp;
  std::fill(acc, acc + nq * ld, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += JT) {
    const int64_t j1 = std::min(n, j0 + JT);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      const int nc = static_cast<int>(std::min<int64_t>(4, (d - c0) / 16));
      for (int64_t r0 = 0; r0 < nq; r0 += 4) {
        const float* pr = p + r0;
        float* ar = acc + r0 * ld;
        switch (std::min<int64_t>(4, nq - r0)) {
          case 1: pv_fp32_nc<1, Key>(nc, pr, v, ldv, j0, j1, c0, ar, ld, key); break;
          case 2: pv_fp32_nc<2, Key>(nc, pr, v, ldv, j0, j1, c0, ar, ld, key); break;
          case 3: pv_fp32_nc<3, Key>(nc, pr, v, ldv, j0, j1, c0, ar, ld, key); break;
          default: pv_fp32_nc<4, Key>(nc, pr, v, ldv, j0, j1, c0, ar, ld, key); break;
        }
      }
    }
  }
}

// 16 output values of query row `acc` (chunk-permuted for bf16, see pv_bf16) divided by `sum`.
VS_AVX512 inline void store_out(const float* acc, int64_t d, __m512 sum, bf16_t* out) {
  // Chunk of 32 as accumulated: lo lanes = values {0-3, 8-11, 16-19, 24-27}, hi = {4-7, 12-15, ...}.
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + c0), hi = _mm512_loadu_ps(acc + c0 + 16);
    store(out + c0, _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), sum), 0xFFFF);
    if (d - c0 > 16) store(out + c0 + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), sum), 0xFFFF);
  }
}

VS_AVX512 inline void store_out(const float* acc, int64_t d, __m512 sum, float* out) {
  for (int64_t c = 0; c < d; c += 16) store(out + c, _mm512_div_ps(_mm512_loadu_ps(acc + c), sum), 0xFFFF);
}

struct AttnShape {
  int64_t b, m, h, kv, d, width, cache_len, kv_len;
  int64_t ks[3], vs[3];  // cache strides of dims 0..2 (elements)
  float scale;
};

template <class T>
VS_AVX512 inline void prefetch_keys(const T* kb, const T* vb, const AttnShape& s, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const char* k = reinterpret_cast<const char*>(kb + j * s.ks[2]);
    const char* v = reinterpret_cast<const char*>(vb + j * s.vs[2]);
    for (int64_t o = 0; o < s.d * static_cast<int64_t>(sizeof(T)); o += 64) {
      _mm_prefetch(k + o, _MM_HINT_T0);
      _mm_prefetch(v + o, _MM_HINT_T1);
    }
  }
}

// All queries of KV head `kv` of row `b`: heads kv * G .. kv * G + G - 1 at the m positions.
// A token tree (anc): each block holds the heads of one token, whose keys are virtual: the cached ones
// before the row's first slot, then its root path in order, exactly the keys and key indices the
// same token has in a chain. So every sum (the lanes of the softmax's, the pairs of bf16 P @ V) runs
// as it would in the chain, and a node's output equals its root path's alone, bit for bit.
template <class T, class Key>
VS_AVX512 void attend_group(const AttnShape& s, const T* qkv, const T* cos, const T* sin, const int64_t* pos,
                            const int64_t* anc, const T* kc, const T* vc, T* out, int64_t b, int64_t kv,
                            int64_t chunk, int64_t n_chunks) {
  constexpr bool tree = std::is_same_v<Key, PathKeys>;
  using Word = typename Attn<T>::Word;
  const int64_t g_size = s.h / s.kv, d = s.d, m = s.m, nq = g_size * m;
  const int64_t words = d / Attn<T>::per_word;
  const int64_t ld = (d + 31) / 32 * 32;  // accumulator row (whole chunks of 32)
  const T* kb = kc + b * s.ks[0] + kv * s.ks[1];
  const T* vb = vc + b * s.vs[0] + kv * s.vs[1];
  const int64_t* pb = pos + b * m;
  int64_t n_row = 0;  // keys any query of this row sees
  for (int64_t i = 0; i < m; ++i) n_row = std::max(n_row, std::min(s.kv_len, pb[i] + 1));
  const int64_t n_pad = (n_row + KB - 1) / KB * KB;
  std::vector<T> qrow(d);
  std::vector<Word> qt(words * 8);  // [words / 2][16 lanes]
  std::vector<float> scores(n_pad * QB), acc(QB * ld);
  std::vector<uint32_t> pairs(sizeof(T) == 2 ? n_pad / 2 * QB : 0);
  alignas(64) int32_t n_of[16];
  alignas(64) float sums[16];
  const __m512 scale = _mm512_set1_ps(s.scale);

  const int64_t g_blocks = (g_size + QB - 1) / QB;  // a tree's blocks per token
  const int64_t n_blocks = tree ? m * g_blocks : (nq + QB - 1) / QB;
  int64_t path[64];  // a tree block's root path: virtual key pb[0] + t is cache row path[t]

  for (int64_t blk = chunk; blk < n_blocks; blk += n_chunks) {  // every n_chunks-th block of QB queries
    // Query r of the block: head kv * G + g0 + r of token i0 (a tree), or query q0 + r in head-major order.
    const int64_t q0 = tree ? 0 : blk * QB, i0 = tree ? blk / g_blocks : 0, g0 = tree ? blk % g_blocks * QB : 0;
    const int64_t nb = tree ? std::min(QB, g_size - g0) : std::min(QB, nq - q0);
    Key key{};
    int64_t n_path = 0;
    if constexpr (tree) {
      for (int64_t t = 0; t <= i0; ++t)
        if ((anc[b * m + i0] >> t) & 1) path[n_path++] = pb[0] + t;
      key = PathKeys{path, pb[0]};
    }
    int64_t n_blk = 0;
    std::fill(qt.begin(), qt.end(), Word(0));
    for (int r = 0; r < 16; ++r) n_of[r] = 0;
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t g = tree ? g0 + r : (q0 + r) / m, i = tree ? i0 : (q0 + r) % m;
      const int64_t row = b * m + i;
      rope_head(qkv + row * s.width + (kv * g_size + g) * d, cos + row * d, sin + row * d, d, qrow.data());
      const Word* w = reinterpret_cast<const Word*>(qrow.data());
      for (int64_t c = 0; c < words; ++c) qt[(c / 2) * 16 + 2 * r + (c & 1)] = w[c];
      n_of[r] = n_of[r + QB] = static_cast<int32_t>(std::min(s.kv_len, tree ? pb[0] + n_path : pb[i] + 1));
      n_blk = std::max<int64_t>(n_blk, n_of[r]);
    }
    // Scores, KB keys at a time (keys past n_blk read key n_blk - 1 again; never used).
    for (int64_t j0 = 0; j0 < n_blk; j0 += KB) {
      if (blk == chunk) prefetch_keys(kb, vb, s, std::min(n_blk, j0 + PF), std::min(n_blk, j0 + PF + KB));
      const T* kp[KB];
      for (int t = 0; t < KB; ++t) kp[t] = kb + key(std::min(j0 + t, n_blk - 1)) * s.ks[2];
      scores_block(qt.data(), kp, d, scale, scores.data() + j0 * QB);
    }
    // Softmax numerators, lane-wise over pairs of keys (zero past each query's own keys), and sums.
    const __m512i nv = _mm512_load_si512(n_of);
    const __m512i step = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n_blk; j += 2) {
      const __m512i jv = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), step);
      mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(nv, jv), mx, _mm512_loadu_ps(scores.data() + j * QB));
    }
    mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));  // both keys' lanes
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_blk; j += 2) {
      const __m512i jv = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), step);
      float* sj = scores.data() + j * QB;
      __m512 e = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(nv, jv), exp512(_mm512_sub_ps(_mm512_loadu_ps(sj), mx)));
      if constexpr (sizeof(T) == 2) {  // bf16 pairs (key j, key j + 1) per query, for vdpbf16ps
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
        const __m128i a = _mm256_castsi256_si128(h), c = _mm256_extracti128_si256(h, 1);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs.data() + (j / 2) * QB), _mm_unpacklo_epi16(a, c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs.data() + (j / 2) * QB + 4), _mm_unpackhi_epi16(a, c));
      } else {
        _mm512_storeu_ps(sj, e);
      }
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_store_ps(sums, _mm512_add_ps(sum, _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(1, 0, 3, 2))));
    // P @ V, then each query's values divided by its sum.
    pv_pass(scores.data(), pairs.data(), vb, s.vs[2], n_blk, d, nb, acc.data(), ld, key);
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t g = tree ? g0 + r : (q0 + r) / m, i = tree ? i0 : (q0 + r) % m;
      store_out(acc.data() + r * ld, d, _mm512_set1_ps(sums[r]), out + (b * m + i) * s.h * d + (kv * g_size + g) * d);
    }
  }
}

// RoPE of the new keys; K and V into the cache.
template <class T>
VS_AVX512 void write_kv(const AttnShape& s, const T* qkv, const T* cos, const T* sin, const int64_t* pos, T* kc,
                        T* vc) {
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t i = 0; i < s.m; ++i) {
      const int64_t row = b * s.m + i, p = pos[row];
      const T* src = qkv + row * s.width + s.h * s.d;
      for (int64_t kv = 0; kv < s.kv; ++kv) {
        rope_head(src + kv * s.d, cos + row * s.d, sin + row * s.d, s.d,
                  kc + b * s.ks[0] + kv * s.ks[1] + p * s.ks[2]);
        copy_head(src + (s.kv + kv) * s.d, s.d, vc + b * s.vs[0] + kv * s.vs[1] + p * s.vs[2]);
      }
    }
  }
}

// Runs group(b, kv, chunk, n_chunks) for every (row, KV head) pair, whose attention is `blocks`
// blocks of queries. Work ~ keys * queries * d (twice); below ~128K multiply-adds in all (a few
// microseconds), one thread does everything: a fork would cost more than it saves. Above, the tasks
// split over threads, which also pulls the (cold) cache rows in in parallel. Fewer (row, KV head)
// pairs than threads (a prefill of one row on a many-core CPU): each pair's query blocks are dealt
// out round-robin over a few tasks, so that the causal work (later queries see more keys) spreads
// evenly. Blocks are the same whatever the split, and so are the results.
template <class Group>
void for_groups(const AttnShape& s, const int64_t* pos, int64_t blocks, const Group& group) {
  int64_t work = 0;
  for (int64_t b = 0; b < s.b; ++b) {
    int64_t n = 0;
    for (int64_t i = 0; i < s.m; ++i) n = std::max(n, std::min(s.kv_len, pos[b * s.m + i] + 1));
    work += n * s.h * s.m * s.d * 2;
  }
  const int64_t groups = s.b * s.kv;
  const int64_t threads = at::get_num_threads();
  const bool fork = work >= (1 << 17);
  const int64_t n_chunks = fork ? std::max<int64_t>(1, std::min(blocks, (threads + groups - 1) / groups)) : 1;
  const int64_t tasks = groups * n_chunks;
  at::parallel_for(0, tasks, fork ? 1 : tasks, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / n_chunks;
      group(g / s.kv, g % s.kv, t % n_chunks, n_chunks);
    }
  });
}

template <class T>
void attend_impl(const AttnShape& s, const T* qkv, const T* cos, const T* sin, const int64_t* pos,
                 const int64_t* anc, T* kc, T* vc, T* out) {
  write_kv(s, qkv, cos, sin, pos, kc, vc);  // all of them before any query attends
  const int64_t blocks = anc ? s.m * ((s.h / s.kv + QB - 1) / QB) : (s.h / s.kv * s.m + QB - 1) / QB;
  for_groups(s, pos, blocks, [&](int64_t b, int64_t kv, int64_t chunk, int64_t n_chunks) {
    if (anc)
      attend_group<T, PathKeys>(s, qkv, cos, sin, pos, anc, kc, vc, out, b, kv, chunk, n_chunks);
    else
      attend_group<T, Contiguous>(s, qkv, cos, sin, pos, anc, kc, vc, out, b, kv, chunk, n_chunks);
  });
}

// ---- AVX2, fp32 ---------------------------------------------------------------------------------
//
// A CPU without AVX-512 BF16 runs fp32 models (dtype "auto"), so it gets the same ops for fp32
// storage on 8 lanes, with the same roundings and the same invariants: a row's or query's arithmetic
// never depends on the other rows or queries in the call nor on the threads. Attention is laid out
// more simply than above: a block is up to four query heads of one token (they share the token's
// keys), each score is one query's dot product with one key (8 lanes in order of d, then the lanes
// summed in a fixed order), softmax runs over the keys in lanes of 8 (key j in lane j mod 8) and
// P @ V accumulates each output value over the keys in order.

#define VS_AVX2 __attribute__((target("avx2,fma")))

namespace avx2 {

VS_AVX2 inline __m256i lanes_below(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(valid, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
VS_AVX2 inline __m256 load(const float* p, int64_t valid) {
  return valid >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(valid));
}
VS_AVX2 inline void store(float* p, __m256 v, int64_t valid) {
  if (valid >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lanes_below(valid), v);
}
// The product is rounded before any later add (no fused multiply-add), as PyTorch's ops round.
VS_AVX2 inline __m256 rounded(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}
// The 8 lanes summed in a fixed order.
VS_AVX2 inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
VS_AVX2 inline float hmax(__m256 v) {
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

// exp512's polynomial on 8 lanes; 2^n is applied as two exact factors 2^(n/2) 2^(n - n/2), which
// rounds as scalef does and reaches n = 128 (+inf past ~88.72).
VS_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_MAX)), _mm256_set1_ps(EXP_MIN));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, f1), f2);
}

VS_AVX2 inline float sum_squares(const float* x, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + c), v1 = _mm256_loadu_ps(x + c + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; c < d; c += 8) {
    const __m256 v = load(x + c, d - c);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  return hsum(_mm256_add_ps(a0, a1));
}

VS_AVX2 void norm_row(const float* x, const float* w, int64_t d, float eps, float ss, float* y) {
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 v = rounded(_mm256_mul_ps(load(x + c, d - c), inv));
    store(y + c, _mm256_mul_ps(v, load(w + c, d - c)), d - c);
  }
}

VS_AVX2 void rms_norm_range(const float* x, const float* w, int64_t r0, int64_t r1, int64_t d, float eps, float* y) {
  for (int64_t r = r0; r < r1; ++r) norm_row(x + r * d, w, d, eps, sum_squares(x + r * d, d), y + r * d);
}

VS_AVX2 void add_rms_norm_range(float* x, const float* delta, const float* w, int64_t r0, int64_t r1, int64_t d,
                                float eps, float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    float* xr = x + r * d;
    const float* dr = delta + r * d;
    for (int64_t c = 0; c < d; c += 8) store(xr + c, _mm256_add_ps(load(xr + c, d - c), load(dr + c, d - c)), d - c);
    norm_row(xr, w, d, eps, sum_squares(xr, d), y + r * d);
  }
}

VS_AVX2 void silu_mul_range(const float* gu, int64_t r0, int64_t r1, int64_t f, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    for (int64_t c = 0; c < f; c += 8) {
      const __m256 gv = load(g + c, f - c);
      const __m256 s = rounded(_mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
      store(y + r * f + c, _mm256_mul_ps(s, load(u + c, f - c)), f - c);
    }
  }
}

VS_AVX2 void rope_head(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < half; c += 8) {
    const int64_t k = half - c;
    const __m256 x1 = load(x + c, k), x2 = load(x + half + c, k);
    const __m256 lo = _mm256_sub_ps(rounded(_mm256_mul_ps(x1, load(cos + c, k))),
                                    rounded(_mm256_mul_ps(x2, load(sin + c, k))));
    const __m256 hi = _mm256_add_ps(rounded(_mm256_mul_ps(x2, load(cos + half + c, k))),
                                    rounded(_mm256_mul_ps(x1, load(sin + half + c, k))));
    store(out + c, lo, k);
    store(out + half + c, hi, k);
  }
}

VS_AVX2 void write_kv(const AttnShape& s, const float* qkv, const float* cos, const float* sin, const int64_t* pos,
                      float* kc, float* vc) {
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t i = 0; i < s.m; ++i) {
      const int64_t row = b * s.m + i, p = pos[row];
      const float* src = qkv + row * s.width + s.h * s.d;
      for (int64_t kv = 0; kv < s.kv; ++kv) {
        rope_head(src + kv * s.d, cos + row * s.d, sin + row * s.d, s.d, kc + b * s.ks[0] + kv * s.ks[1] + p * s.ks[2]);
        std::memcpy(vc + b * s.vs[0] + kv * s.vs[1] + p * s.vs[2], src + (s.kv + kv) * s.d, s.d * sizeof(float));
      }
    }
  }
}

constexpr int64_t NQ = 4;  // query heads per block

// One block of nq query heads (q: [nq][d], rotated) over its n keys (cache row key(j) of kb / vb):
// scores and softmax numerators into p ([nq][ldp]), then out[r] = P @ V / sum.
template <int Q, class Key>
VS_AVX2 void attend_block(const float* q, const float* kb, const float* vb, int64_t ldk, int64_t ldv, int64_t n,
                          int64_t d, float scale, Key key, float* p, int64_t ldp, float* const* out) {
  // Scores, two keys at a time (a lone last key computes exactly as it would in a pair).
  int64_t j = 0;
  for (; j < n; j += 2) {
    const bool two = j + 1 < n;
    const float* k0 = kb + key(j) * ldk;
    const float* k1 = kb + key(two ? j + 1 : j) * ldk;
    __m256 a[Q][2];
    for (int r = 0; r < Q; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + c), x1 = _mm256_loadu_ps(k1 + c);
#pragma GCC unroll 4
      for (int r = 0; r < Q; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * d + c);
        a[r][0] = _mm256_fmadd_ps(qv, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, x1, a[r][1]);
      }
    }
    for (int r = 0; r < Q; ++r) {
      p[r * ldp + j] = hsum(a[r][0]) * scale;
      if (two) p[r * ldp + j + 1] = hsum(a[r][1]) * scale;
    }
  }
  // Softmax numerators (zero past the n keys) and their sums.
  float sums[Q];
  for (int r = 0; r < Q; ++r) {
    float* pr = p + r * ldp;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; c += 8)
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), load(pr + c, n - c),
                                              _mm256_castsi256_ps(lanes_below(n - c))));
    const __m256 m = _mm256_set1_ps(hmax(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c += 8) {
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(load(pr + c, n - c), m)),
                                     _mm256_castsi256_ps(lanes_below(n - c)));
      store(pr + c, e, n - c);
      sum = _mm256_add_ps(sum, e);
    }
    sums[r] = hsum(sum);
  }
  // P @ V, 16 output values at a time, each summed over the keys in order; then / sum.
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    __m256 a[Q][2];
    for (int r = 0; r < Q; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < n; ++jj) {
      const float* vr = vb + key(jj) * ldv + c0;
      const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
#pragma GCC unroll 4
      for (int r = 0; r < Q; ++r) {
        const __m256 pj = _mm256_set1_ps(p[r * ldp + jj]);
        a[r][0] = _mm256_fmadd_ps(pj, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pj, v1, a[r][1]);
      }
    }
    for (int r = 0; r < Q; ++r) {
      const __m256 sr = _mm256_set1_ps(sums[r]);
      _mm256_storeu_ps(out[r] + c0, _mm256_div_ps(a[r][0], sr));
      _mm256_storeu_ps(out[r] + c0 + 8, _mm256_div_ps(a[r][1], sr));
    }
  }
}

// All query heads of KV head `kv` of row `b`, in blocks of up to NQ heads of one token: every
// n_chunks-th block from `chunk`. A token tree's node sees the cached keys before the row's first
// slot and then its root path, the keys (and key indices) the same token has in a chain.
template <class Key>
VS_AVX2 void attend_group(const AttnShape& s, const float* qkv, const float* cos, const float* sin, const int64_t* pos,
                          const int64_t* anc, const float* kc, const float* vc, float* out, int64_t b, int64_t kv,
                          int64_t chunk, int64_t n_chunks) {
  constexpr bool tree = std::is_same_v<Key, PathKeys>;
  const int64_t g_size = s.h / s.kv, d = s.d, m = s.m;
  const int64_t g_blocks = (g_size + NQ - 1) / NQ;
  const float* kb = kc + b * s.ks[0] + kv * s.ks[1];
  const float* vb = vc + b * s.vs[0] + kv * s.vs[1];
  const int64_t* pb = pos + b * m;
  int64_t n_row = 0;
  for (int64_t i = 0; i < m; ++i) n_row = std::max(n_row, std::min(s.kv_len, pb[i] + 1));
  const int64_t ldp = (n_row + 7) / 8 * 8;
  std::vector<float> q(NQ * d), p(NQ * ldp);
  int64_t path[64];
  for (int64_t blk = chunk; blk < m * g_blocks; blk += n_chunks) {
    const int64_t i = blk / g_blocks, g0 = blk % g_blocks * NQ, nb = std::min(NQ, g_size - g0);
    const int64_t row = b * m + i;
    Key key{};
    int64_t n = std::min(s.kv_len, pb[i] + 1);
    if constexpr (tree) {
      int64_t n_path = 0;
      for (int64_t t = 0; t <= i; ++t)
        if ((anc[row] >> t) & 1) path[n_path++] = pb[0] + t;
      key = PathKeys{path, pb[0]};
      n = std::min(s.kv_len, pb[0] + n_path);
    }
    float* o[NQ];
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t head = kv * g_size + g0 + r;
      rope_head(qkv + row * s.width + head * d, cos + row * d, sin + row * d, d, q.data() + r * d);
      o[r] = out + row * s.h * d + head * d;
    }
    switch (nb) {
      case 1: attend_block<1>(q.data(), kb, vb, s.ks[2], s.vs[2], n, d, s.scale, key, p.data(), ldp, o); break;
      case 2: attend_block<2>(q.data(), kb, vb, s.ks[2], s.vs[2], n, d, s.scale, key, p.data(), ldp, o); break;
      case 3: attend_block<3>(q.data(), kb, vb, s.ks[2], s.vs[2], n, d, s.scale, key, p.data(), ldp, o); break;
      default: attend_block<4>(q.data(), kb, vb, s.ks[2], s.vs[2], n, d, s.scale, key, p.data(), ldp, o); break;
    }
  }
}

void attend_impl(const AttnShape& s, const float* qkv, const float* cos, const float* sin, const int64_t* pos,
                 const int64_t* anc, float* kc, float* vc, float* out) {
  write_kv(s, qkv, cos, sin, pos, kc, vc);  // all of them before any query attends
  for_groups(s, pos, s.m * ((s.h / s.kv + NQ - 1) / NQ), [&](int64_t b, int64_t kv, int64_t chunk, int64_t n_chunks) {
    if (anc)
      attend_group<PathKeys>(s, qkv, cos, sin, pos, anc, kc, vc, out, b, kv, chunk, n_chunks);
    else
      attend_group<Contiguous>(s, qkv, cos, sin, pos, anc, kc, vc, out, b, kv, chunk, n_chunks);
  });
}

}  // namespace avx2

// ---- entry points ---------------------------------------------------------------------------------

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensor expected");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, what, ": fp32 or bf16 expected");
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  check_float(x, what);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": contiguous [R, D] expected");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1),
              what, ": weight of x's dtype, one value per column");
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  check_float(x_in, "rms_norm");
  check_cpu(x_in);
  const auto x = x_in.contiguous();
  const auto w = w_in.to(x.scalar_type()).contiguous();
  check_rows(x, w, "rms_norm");
  auto y = torch::empty_like(x);
  const int64_t r = x.size(0), d = x.size(1);
  const float e = static_cast<float>(eps);
  const bool bf16 = is_bf16(x);
  void* yp = y.data_ptr();
  const void *xp = x.data_ptr(), *wp = w.data_ptr();
  at::parallel_for(0, r, row_grain(d), [&](int64_t r0, int64_t r1) {
    if (bf16) {
      rms_norm_range(static_cast<const bf16_t*>(xp), static_cast<const bf16_t*>(wp), r0, r1, d, e,
                     static_cast<bf16_t*>(yp));
    } else if (wide()) {
      rms_norm_range(static_cast<const float*>(xp), static_cast<const float*>(wp), r0, r1, d, e,
                     static_cast<float*>(yp));
    } else {
      avx2::rms_norm_range(static_cast<const float*>(xp), static_cast<const float*>(wp), r0, r1, d, e,
                           static_cast<float*>(yp));
    }
  });
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& delta_in, const torch::Tensor& w_in, double eps) {
  check_float(x, "add_rms_norm");
  check_cpu(x);
  const auto w = w_in.to(x.scalar_type()).contiguous();
  check_rows(x, w, "add_rms_norm");  // x itself must be contiguous: it is updated in place
  TORCH_CHECK(delta_in.sizes() == x.sizes(), "add_rms_norm: delta of x's shape");
  const auto delta = delta_in.to(x.scalar_type()).contiguous();
  auto y = torch::empty_like(x);
  const int64_t r = x.size(0), d = x.size(1);
  const float e = static_cast<float>(eps);
  const bool bf16 = is_bf16(x);
  void *xp = x.data_ptr(), *yp = y.data_ptr();
  const void *dp = delta.data_ptr(), *wp = w.data_ptr();
  at::parallel_for(0, r, row_grain(d), [&](int64_t r0, int64_t r1) {
    if (bf16) {
      add_rms_norm_range(static_cast<bf16_t*>(xp), static_cast<const bf16_t*>(dp), static_cast<const bf16_t*>(wp),
                         r0, r1, d, e, static_cast<bf16_t*>(yp));
    } else if (wide()) {
      add_rms_norm_range(static_cast<float*>(xp), static_cast<const float*>(dp), static_cast<const float*>(wp), r0,
                         r1, d, e, static_cast<float*>(yp));
    } else {
      avx2::add_rms_norm_range(static_cast<float*>(xp), static_cast<const float*>(dp), static_cast<const float*>(wp),
                               r0, r1, d, e, static_cast<float*>(yp));
    }
  });
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up_in) {
  check_float(gate_up_in, "silu_mul");
  check_cpu(gate_up_in);
  const auto gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: contiguous [R, 2F] expected");
  const int64_t r = gate_up.size(0), f = gate_up.size(1) / 2;
  auto y = torch::empty({r, f}, gate_up.options());
  const bool bf16 = is_bf16(gate_up);
  const void* gp = gate_up.data_ptr();
  void* yp = y.data_ptr();
  at::parallel_for(0, r, row_grain(2 * f), [&](int64_t r0, int64_t r1) {
    if (bf16) {
      silu_mul_range(static_cast<const bf16_t*>(gp), r0, r1, f, static_cast<bf16_t*>(yp));
    } else if (wide()) {
      silu_mul_range(static_cast<const float*>(gp), r0, r1, f, static_cast<float*>(yp));
    } else {
      avx2::silu_mul_range(static_cast<const float*>(gp), r0, r1, f, static_cast<float*>(yp));
    }
  });
  return y;
}

torch::Tensor attend(const torch::Tensor& qkv_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                     const torch::Tensor& positions_in, torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t kv_len,
                     int64_t n_heads, int64_t n_kv_heads, const c10::optional<torch::Tensor>& ancestors_in) {
  check_float(qkv_in, "attend: qkv");
  check_cpu(qkv_in);
  const auto qkv = qkv_in.contiguous();
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto positions = positions_in.to(torch::kLong).contiguous();
  const auto type = qkv.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "attend: k_cache and v_cache [B, KV, L, D] of one shape");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "attend: CPU caches expected");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "attend: cache rows must be contiguous");
  AttnShape s;
  s.b = k_cache.size(0);
  s.kv = k_cache.size(1);
  s.cache_len = k_cache.size(2);
  s.d = k_cache.size(3);
  s.h = n_heads;
  s.kv_len = kv_len;
  TORCH_CHECK(n_kv_heads == s.kv && n_heads > 0 && n_heads % n_kv_heads == 0, "attend: heads do not match the cache");
  TORCH_CHECK(s.d % 16 == 0 && s.d >= 16 && s.d <= 256, "attend: head_dim must be a multiple of 16 up to 256");
  TORCH_CHECK(kv_len >= 1 && kv_len <= s.cache_len, "attend: kv_len out of range");
  s.width = (s.h + 2 * s.kv) * s.d;
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(0) == s.b && qkv.size(2) == s.width,
              "attend: qkv contiguous [B, m, (H + 2 KV) * D]");
  s.m = qkv.size(1);
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == type, "attend: every tensor in qkv's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 3 &&
                  cos.size(0) == s.b && cos.size(1) == s.m && cos.size(2) == s.d,
              "attend: cos/sin contiguous [B, m, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() && positions.dim() == 2 &&
                  positions.size(0) == s.b && positions.size(1) == s.m,
              "attend: positions int64 [B, m]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.b * s.m; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < s.cache_len, "attend: position ", pos[i], " outside the cache");
  torch::Tensor ancestors;
  const int64_t* anc = nullptr;
  if (ancestors_in.has_value()) {
    ancestors = ancestors_in->to(torch::kLong).contiguous();
    TORCH_CHECK(ancestors.dim() == 2 && ancestors.size(0) == s.b && ancestors.size(1) == s.m && s.m <= 63,
                "attend: ancestors int64 [B, m] with m <= 63");
    anc = ancestors.data_ptr<int64_t>();
    for (int64_t b = 0; b < s.b; ++b) {
      for (int64_t i = 0; i < s.m; ++i) {
        const int64_t a = anc[b * s.m + i];
        TORCH_CHECK(pos[b * s.m + i] == pos[b * s.m] + i, "attend: a tree's slots must be consecutive per row");
        TORCH_CHECK(a >= 0 && (a >> i) == 1,
                    "attend: ancestors[b, i] must hold bit i and only bits below it");
      }
    }
  }
  for (int i = 0; i < 3; ++i) {
    s.ks[i] = k_cache.stride(i);
    s.vs[i] = v_cache.stride(i);
  }
  s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d)));
  auto out = torch::empty({s.b, s.m, s.h * s.d}, qkv.options());
  if (s.b == 0 || s.m == 0) return out;
  if (type == torch::kBFloat16) {
    attend_impl(s, static_cast<const bf16_t*>(qkv.data_ptr()), static_cast<const bf16_t*>(cos.data_ptr()),
                static_cast<const bf16_t*>(sin.data_ptr()), pos, anc, static_cast<bf16_t*>(k_cache.data_ptr()),
                static_cast<bf16_t*>(v_cache.data_ptr()), static_cast<bf16_t*>(out.data_ptr()));
  } else {
    (wide() ? attend_impl<float> : avx2::attend_impl)(s, qkv.data_ptr<float>(), cos.data_ptr<float>(),
                                                      sin.data_ptr<float>(), pos, anc, k_cache.data_ptr<float>(),
                                                      v_cache.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

}  // namespace

// Called from wo_gemm.cpp's PYBIND11_MODULE: one extension module for both sources. The namespace
// carries the build tag (VS_NS), so two builds loaded in one process never share this symbol.
namespace VS_NS {
void register_small_ops(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "y = round(round(x * rsqrt(mean(x^2) + eps)) * w) per row", py::arg("x"),
        py::arg("w"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then rms_norm(x)", py::arg("x"), py::arg("delta"),
        py::arg("w"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up [R, 2F] -> [R, F]", py::arg("gate_up"));
  m.def("attend", &attend, "RoPE, K/V cache write and grouped-query attention of a few queries per row",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("kv_len"), py::arg("n_heads"), py::arg("n_kv_heads"),
        py::arg("ancestors") = py::none());
}
}  // namespace VS_NS
