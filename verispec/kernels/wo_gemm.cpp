// Weight-only int4 / int8 (and dense bf16) GEMM for a few activation rows (M = 1..8 per pass), AVX-512 BF16;
// int4 / int8 on 8-bit activations also with AVX2 (see "AVX2" below).
//
// y[m, n] = sum_k x[m, k] * w[n, k], weights streamed from memory once per call.
//
// Output rows sit in vector lanes: one zmm holds 16 output rows as fp32 accumulators, and a
// "tile" is one zmm of bf16 weights = 16 rows x 2 consecutive k (a pair per 32-bit lane), the
// operand of vdpbf16ps. Each unpacked tile is used by all M activation rows (the activation
// pair x[m, k..k+1] is broadcast to all lanes), so the weight bytes are read and unpacked once
// whatever M is.
//
// int4 layout (per block of 16 output rows, K/2 * 16 bytes, blocks one after another):
//   chunks of 8 k (64 bytes = 32 little-endian words); word j holds row j/2 and, in its four
//   nibbles t = 0..3, the codes for k = 8 * chunk + 2 * t + (j & 1). Four vpermw against a
//   32-entry table turn a chunk into four tiles of exact bf16 values q - 8.
//   Scales and zeros: [N/16, K/32, 16] dwords, bf16 scale in the low half and bf16 zero in the
//   high half (PyTorch's [.., 2] order): y += scale * sum(q-8)x + zero * sum(x) per group of 32.
//   With 8-bit activations (q8, AVX-512 VNNI) the same bytes feed vpdpbusd: dword i of a chunk is row
//   i's eight codes, its low nibbles those of k = 0, 4, 1, 5 and its high nibbles k = 2, 6, 3, 7 (of
//   the chunk), so each row's activations are quantized in that order and no weight is repacked.
// int8 layout: [ceil(N/16), K/2, 16, 2] (rows padded with zeros to a multiple of 16); a pair
//   chunk of 32 bytes converts (sign-extend, int -> fp32 -> bf16, exact) into one tile. With 8-bit
//   activations one vpermw turns a 64-byte line (two pairs) into row i's four consecutive k in
//   dword i, and flipping the sign bits makes them q + 128 (unsigned) for vpdpbusd.
// bf16 layout: the same [ceil(N/16), K/2, 16, 2] with bf16 values: every 64 bytes are a tile as
//   they are, so dense bf16 weights stream with the same loop and no unpacking at all.
//
// For many rows (a prompt's prefill) the work is compute-bound and oneDNN's bf16 GEMM is faster:
// int4_dequant / int8_dequant / bf16_unpack expand a weight into a temporary bf16 [N, K] for it
// (see "dequantization" below; the layers in verispec/models/linear.py choose by tokens per row).
//
// Every function using AVX-512 or AVX2 carries a target attribute, so this file is compiled without
// -mavx* and the library loads on any x86-64 CPU; cpu_supported() says whether the AVX-512 BF16
// kernels run, q8_isa() which 8-bit-activation kernels do.
// The per-row arithmetic does not depend on M nor on how rows are chunked or threaded: a row
// of x gives bit-identical outputs whether it is verified alone or with others.
//
// small_ops.cpp (the fused RMSNorm / RoPE + attention / SwiGLU ops of a decode step) is compiled
// into the same extension; this file's module registers its functions too.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define VS_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
#define VS_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define VS_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t BN = 16;  // output rows per block (one zmm of fp32)
constexpr int64_t MB = 8;   // activation rows per pass over a block
constexpr int64_t GS = 32;  // int4 group size
// Software prefetch distance (bytes ahead in a block's weight stream; the scales/zeros stream is
// prefetched a quarter as far). Weights are read once per call, so the hardware prefetchers
// alone leave the kernels latency-bound; 4-8 KiB measured best here (6 KiB: see the docs).
constexpr int64_t PREFETCH = 6144;

bool cpu_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool cpu_supports_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_supported() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_supports_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// Which kernels multiply 8-bit activations here: 512 (AVX-512 VNNI, beside the BF16 kernels), 256
// (AVX2: the int4/int8 q8 kernels are then the only ones that run) or 0 (none).
int q8_isa() {
  static const int isa = cpu_supports_vnni() ? 512 : cpu_supports_avx2() ? 256 : 0;
  return isa;
}

// fp32 -> bf16 as c10::BFloat16 rounds (nearest even on the bits; NaN -> 0x7FC0).
inline uint16_t bf16_round(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  if (std::isnan(v)) return 0x7FC0;
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// ---- int4 -------------------------------------------------------------------------------

// bf16 bits of (i & 15) - 8 for i = 0..31 (vpermw reads 5 index bits; the 5th is the next nibble's):
// an int4 code to its exact bf16 value q - 8, for the matmul and the dequantize kernels alike.
alignas(64) const uint16_t lut_words[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// One 16-row block against M rows of x: out[m][16] = sum over K (fp32).
template <int M>
VS_AVX512 inline void int4_block(const uint8_t* __restrict w, const uint32_t* __restrict sz,
                                 const uint16_t* __restrict x, int64_t ldx, const float* __restrict xs,
                                 int64_t ldxs, int64_t groups, float* __restrict out) {
  const __m512i lut = _mm512_load_si512(lut_words);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 y[M];
  for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // Two accumulators per row and group (even / odd k pairs), reset every group: short
    // dependency chains, and groups overlap in the out-of-order window.
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm512_setzero_ps();
      a1[m] = _mm512_setzero_ps();
    }
    const uint8_t* wg = w + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(sz + g * 16) + PREFETCH / 4, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + o * 64 + PREFETCH), _MM_HINT_T0);
      const __m512i d = _mm512_loadu_si512(wg + o * 64);
      const __m512i t0 = _mm512_permutexvar_epi16(d, lut);
      const __m512i t1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), lut);
      const __m512i t2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 8), lut);
      const __m512i t3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 12), lut);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(x + m * ldx) + g * 16 + o * 4;
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)t0, (__m512bh)_mm512_set1_epi32(xp[0]));
        a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)t1, (__m512bh)_mm512_set1_epi32(xp[1]));
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)t2, (__m512bh)_mm512_set1_epi32(xp[2]));
        a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)t3, (__m512bh)_mm512_set1_epi32(xp[3]));
      }
    }
    const __m512i s2 = _mm512_loadu_si512(sz + g * 16);
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(s2, 16));
    const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(s2, hi_mask));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      y[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), sc, y[m]);
      y[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * ldxs + g]), zr, y[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * BN, y[m]);
}

// All rows of x (in passes of up to MB; the block stays in L1/L2 between passes) against one block.
VS_AVX512 void int4_rows(const uint8_t* w, const uint32_t* sz, const uint16_t* x, int64_t k, const float* xs,
                         int64_t rows, float* out) {
  const int64_t groups = k / GS;
  for (int64_t m0 = 0; m0 < rows; m0 += MB) {
    const uint16_t* xm = x + m0 * k;
    const float* xsm = xs + m0 * groups;
    float* o = out + m0 * BN;
    switch (std::min(MB, rows - m0)) {
      case 1: int4_block<1>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 2: int4_block<2>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 3: int4_block<3>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 4: int4_block<4>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 5: int4_block<5>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 6: int4_block<6>(w, sz, xm, k, xsm, groups, groups, o); break;
      case 7: int4_block<7>(w, sz, xm, k, xsm, groups, groups, o); break;
      default: int4_block<8>(w, sz, xm, k, xsm, groups, groups, o); break;
    }
  }
}

// ---- int4 x 8-bit activations (q8) -------------------------------------------------------

// Byte shuffles (per 16-byte lane) of a group's 32 activation codes: as they are, or in the int4
// weights' chunk order (k = 0, 4, 1, 5, 2, 6, 3, 7 per 8).
alignas(32) const uint8_t code_order[2][32] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}};

// Each row's activations in groups of 32, as llama.cpp's Q8_0: codes round(x * 127 / max|x|) (for
// int4 weights in their chunk order, k = 0, 4, 1, 5, 2, 6, 3, 7 per 8; else in order), the group's
// scale max|x| / 127, -bias times the codes' sum (the weights' unsigned offset, 8 for int4 codes and
// 128 for int8 ones, folded into the integer accumulator) and the fp32 sum of x (int4's zero points).
// Per row: a row's result never depends on the rows beside it.
VS_AVX512 void quantize_groups(const uint16_t* x, int64_t rows, int64_t k, bool int4_order, int32_t bias, int8_t* xq,
                               float* xscale, int32_t* offset, float* xsum) {
  const int64_t groups = k / GS;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(code_order[int4_order]));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* p = x + r * k + g * GS;
      const __m512 lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      const __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
      const float amax =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(qhi), _mm512_cvtepi32_epi8(qlo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + g * GS), _mm256_shuffle_epi8(bytes, order));
      const int64_t i = r * groups + g;
      xscale[i] = amax / 127.0f;
      offset[i] = -bias * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

// One 16-row block against M rows of quantized x: per group, sum (q - 8) * xq in int32 (vpdpbusd:
// unsigned codes times signed activations, four k per lane), then scale * xscale * that + zero * xsum.
template <int M>
VS_AVX512_VNNI inline void q8_block(const uint8_t* __restrict w, const uint32_t* __restrict sz,
                                    const int8_t* __restrict xq, int64_t ldx, const float* __restrict xscale,
                                    const int32_t* __restrict offset, const float* __restrict xsum, int64_t ldg,
                                    int64_t groups, float* __restrict out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 y[M];
  for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // Two integer accumulators per row (low and high nibbles): half as long dependency chains, and
    // integer sums are exact in any order.
    __m512i a[M], b[M];
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_set1_epi32(offset[m * ldg + g]);
      b[m] = _mm512_setzero_si512();
    }
    const uint8_t* wg = w + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(sz + g * 16) + PREFETCH / 4, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + c * 64 + PREFETCH), _MM_HINT_T0);
      const __m512i d = _mm512_loadu_si512(wg + c * 64);
      const __m512i lo = _mm512_and_si512(d, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(d, 4), nibble);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(xq + m * ldx + g * GS + c * 8);
        a[m] = _mm512_dpbusd_epi32(a[m], lo, _mm512_set1_epi32(xp[0]));
        b[m] = _mm512_dpbusd_epi32(b[m], hi, _mm512_set1_epi32(xp[1]));
      }
    }
    const __m512i s2 = _mm512_loadu_si512(sz + g * 16);
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(s2, 16));
    const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(s2, hi_mask));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(xscale[m * ldg + g]));
      y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[m], b[m])), s, y[m]);
      y[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * ldg + g]), zr, y[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * BN, y[m]);
}

VS_AVX2 void quantize_groups_avx2(const uint16_t* x, int64_t rows, int64_t k, bool int4_order, int32_t bias,
                                  int8_t* xq, float* xscale, int32_t* offset, float* xsum);

// A call's activations as quantize_groups leaves them (empty where a call runs without q8).
struct Q8Activations {
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<int32_t> offset;

  Q8Activations() = default;
  Q8Activations(const uint16_t* x, int64_t rows, int64_t k, bool int4_order, int32_t bias)
      : xq(rows * k), xscale(rows * (k / GS)), xsum(rows * (k / GS)), offset(rows * (k / GS)) {
    (q8_isa() == 512 ? quantize_groups : quantize_groups_avx2)(x, rows, k, int4_order, bias, xq.data(),
                                                               xscale.data(), offset.data(), xsum.data());
  }
};

VS_AVX512_VNNI void q8_rows(const uint8_t* w, const uint32_t* sz, const Q8Activations& x, int64_t k, int64_t rows,
                            float* out) {
  const int64_t groups = k / GS;
  for (int64_t m0 = 0; m0 < rows; m0 += MB) {
    const int8_t* xm = x.xq.data() + m0 * k;
    const int64_t o = m0 * groups;
    const float *xs = x.xscale.data() + o, *xt = x.xsum.data() + o;
    const int32_t* off = x.offset.data() + o;
    float* po = out + m0 * BN;
    switch (std::min(MB, rows - m0)) {
      case 1: q8_block<1>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 2: q8_block<2>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 3: q8_block<3>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 4: q8_block<4>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 5: q8_block<5>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 6: q8_block<6>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 7: q8_block<7>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      default: q8_block<8>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
    }
  }
}

// Word j of a 64-byte int8 line (two pairs of k for 16 rows) -> word idx[j]: row i's dword holds its
// pair from the first half, then its pair from the second, i.e. four consecutive k.
alignas(64) const uint16_t quad_words[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// One 16-row int8 block against M rows of quantized x: per group of 32, sum (q + 128) * xq in int32
// (minus 128 * sum xq, the accumulator's start), times the group's xscale; the row scale comes last.
template <int M>
VS_AVX512_VNNI inline void q8_int8_block(const int8_t* __restrict w, const int8_t* __restrict xq, int64_t ldx,
                                         const float* __restrict xscale, const int32_t* __restrict offset,
                                         int64_t ldg, int64_t groups, float* __restrict out) {
  const __m512i idx = _mm512_load_si512(quad_words);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 y[M];
  for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[M], b[M];  // even and odd lines: shorter chains, exact in any order
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_set1_epi32(offset[m * ldg + g]);
      b[m] = _mm512_setzero_si512();
    }
    const int8_t* wg = w + g * 512;
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + l * 64 + PREFETCH), _MM_HINT_T0);
      const __m512i t = _mm512_xor_si512(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(wg + l * 64)), flip);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * ldx + g * GS + l * 4));
        if (l % 2 == 0) {
          a[m] = _mm512_dpbusd_epi32(a[m], t, xv);
        } else {
          b[m] = _mm512_dpbusd_epi32(b[m], t, xv);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[m], b[m])), _mm512_set1_ps(xscale[m * ldg + g]),
                             y[m]);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * BN, y[m]);
}

VS_AVX512_VNNI void q8_int8_rows(const int8_t* w, const Q8Activations& x, int64_t k, int64_t rows, float* out) {
  const int64_t groups = k / GS;
  for (int64_t m0 = 0; m0 < rows; m0 += MB) {
    const int8_t* xm = x.xq.data() + m0 * k;
    const int64_t o = m0 * groups;
    const float* xs = x.xscale.data() + o;
    const int32_t* off = x.offset.data() + o;
    float* po = out + m0 * BN;
    switch (std::min(MB, rows - m0)) {
      case 1: q8_int8_block<1>(w, xm, k, xs, off, groups, groups, po); break;
      case 2: q8_int8_block<2>(w, xm, k, xs, off, groups, groups, po); break;
      case 3: q8_int8_block<3>(w, xm, k, xs, off, groups, groups, po); break;
      case 4: q8_int8_block<4>(w, xm, k, xs, off, groups, groups, po); break;
      case 5: q8_int8_block<5>(w, xm, k, xs, off, groups, groups, po); break;
      case 6: q8_int8_block<6>(w, xm, k, xs, off, groups, groups, po); break;
      case 7: q8_int8_block<7>(w, xm, k, xs, off, groups, groups, po); break;
      default: q8_int8_block<8>(w, xm, k, xs, off, groups, groups, po); break;
    }
  }
}

// ---- int8 and bf16 ----------------------------------------------------------------------

VS_AVX512 inline __m512i int8_tile_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi: byte order kept
}

// Tiles of the two weight-only formats that need no group scales: int8 (unpacked to exact bf16
// per tile) and bf16 (the packed weight already is the vdpbf16ps operand). One tile is 16 rows x
// 2 consecutive k; `lines` 64-byte cache lines hold two tiles.
struct Int8Tiles {
  using W = int8_t;
  static constexpr int lines = 1;
  VS_AVX512 static inline __m512i load(const int8_t* p) { return int8_tile_bf16(p); }
};

struct Bf16Tiles {
  using W = uint16_t;
  static constexpr int lines = 2;
  VS_AVX512 static inline __m512i load(const uint16_t* p) { return _mm512_loadu_si512(p); }
};

template <class Tiles, int M>
VS_AVX512 inline void pair_block(const typename Tiles::W* __restrict w, const uint16_t* __restrict x, int64_t ldx,
                                 int64_t pairs, float* __restrict out) {
  __m512 y[M];
  for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 16 <= pairs; p += 16) {  // groups of 32 k, as for int4
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm512_setzero_ps();
      a1[m] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int q = 0; q < 16; q += 2) {
      const typename Tiles::W* wp = w + (p + q) * 32;
      for (int l = 0; l < Tiles::lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(wp) + PREFETCH + 64 * l, _MM_HINT_T0);
      const __m512i t0 = Tiles::load(wp);
      const __m512i t1 = Tiles::load(wp + 32);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(x + m * ldx) + p + q;
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)t0, (__m512bh)_mm512_set1_epi32(xp[0]));
        a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)t1, (__m512bh)_mm512_set1_epi32(xp[1]));
      }
    }
    for (int m = 0; m < M; ++m) y[m] = _mm512_add_ps(y[m], _mm512_add_ps(a0[m], a1[m]));
  }
  if (p < pairs) {  // K not a multiple of 32
    __m512 a0[M];
    for (int m = 0; m < M; ++m) a0[m] = _mm512_setzero_ps();
    for (; p < pairs; ++p) {
      const __m512i t0 = Tiles::load(w + p * 32);
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(x + m * ldx) + p;
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)t0, (__m512bh)_mm512_set1_epi32(xp[0]));
      }
    }
    for (int m = 0; m < M; ++m) y[m] = _mm512_add_ps(y[m], a0[m]);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * BN, y[m]);
}

template <class Tiles>
VS_AVX512 void pair_rows(const typename Tiles::W* w, const uint16_t* x, int64_t k, int64_t rows, float* out) {
  const int64_t pairs = k / 2;
  for (int64_t m0 = 0; m0 < rows; m0 += MB) {
    const uint16_t* xm = x + m0 * k;
    float* o = out + m0 * BN;
    switch (std::min(MB, rows - m0)) {
      case 1: pair_block<Tiles, 1>(w, xm, k, pairs, o); break;
      case 2: pair_block<Tiles, 2>(w, xm, k, pairs, o); break;
      case 3: pair_block<Tiles, 3>(w, xm, k, pairs, o); break;
      case 4: pair_block<Tiles, 4>(w, xm, k, pairs, o); break;
      case 5: pair_block<Tiles, 5>(w, xm, k, pairs, o); break;
      case 6: pair_block<Tiles, 6>(w, xm, k, pairs, o); break;
      case 7: pair_block<Tiles, 7>(w, xm, k, pairs, o); break;
      default: pair_block<Tiles, 8>(w, xm, k, pairs, o); break;
    }
  }
}

// ---- shared ---------------------------------------------------------------------------------

// 16 values from fp32 or bf16 memory (masked to `valid`), as fp32.
VS_AVX512 inline __m512 load16(const void* p, bool bf16, int valid) {
  const __mmask16 k = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(k, p);
}

struct Epilogue {
  const void* scale = nullptr;  // per output row (int8), fp32 or bf16
  bool scale_bf16 = false;
  const void* bias = nullptr;
  bool bias_bf16 = false;
  void* y = nullptr;
  bool out_bf16 = true;
  int64_t ldy = 0;
  int64_t n = 0;      // output columns
  int64_t rows = 0;   // M
  int64_t splits = 1; // x rows s * rows + m add up into output row m
};

// acc: [splits * rows][16] fp32 sums for output columns n0..n0+15.
VS_AVX512 void finish_block(const Epilogue& e, const float* acc, int64_t n0) {
  const int valid = static_cast<int>(std::min<int64_t>(BN, e.n - n0));
  const __mmask16 k = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  const size_t esz = e.out_bf16 ? 2 : 4;
  __m512 scale = _mm512_set1_ps(1.0f), bias = _mm512_setzero_ps();
  if (e.scale) scale = load16(static_cast<const char*>(e.scale) + n0 * (e.scale_bf16 ? 2 : 4), e.scale_bf16, valid);
  if (e.bias) bias = load16(static_cast<const char*>(e.bias) + n0 * (e.bias_bf16 ? 2 : 4), e.bias_bf16, valid);
  for (int64_t m = 0; m < e.rows; ++m) {
    __m512 v = _mm512_loadu_ps(acc + m * BN);
    for (int64_t s = 1; s < e.splits; ++s) v = _mm512_add_ps(v, _mm512_loadu_ps(acc + (s * e.rows + m) * BN));
    if (e.scale) v = _mm512_mul_ps(v, scale);
    if (e.bias) v = _mm512_add_ps(v, bias);
    char* dst = static_cast<char*>(e.y) + (m * e.ldy + n0) * esz;
    if (e.out_bf16) {
      _mm256_mask_storeu_epi16(dst, k, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_mask_storeu_ps(dst, k, v);
    }
  }
}

// Sums of each group of 32 bf16 values of each row: out[r * groups + g].
VS_AVX512 void group_sums(const uint16_t* x, int64_t rows, int64_t k, float* out) {
  const int64_t groups = k / GS;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* p = x + r * k + g * GS;
      const __m512 lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      const __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
      out[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

int64_t grain_for(int64_t block_bytes) {
  // At least ~48 KiB of weights per task, so tiny layers do not pay for a thread fork.
  return std::max<int64_t>(1, (48 << 10) / std::max<int64_t>(1, block_bytes));
}

void check_cpu() {
  static const bool ok = cpu_supported();
  TORCH_CHECK(ok, "verispec kernels: this CPU lacks AVX-512 BF16");
}

// int4_mm / int8_mm: q8 runs on AVX-512 VNNI or AVX2 CPUs, the bf16-activation path needs AVX-512 BF16.
void check_q8_cpu(bool q8) {
  if (!q8) return check_cpu();
  TORCH_CHECK(q8_isa() != 0, "verispec kernels: 8-bit activations need AVX-512 VNNI or AVX2, which this CPU lacks");
}

void set_epilogue_out(Epilogue& e, const torch::Tensor& y, const c10::optional<torch::Tensor>& bias) {
  e.y = y.data_ptr();
  e.out_bf16 = y.scalar_type() == torch::kBFloat16;
  e.ldy = y.size(1);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == e.n, "bias: contiguous, one value per output");
    TORCH_CHECK(bias->scalar_type() == torch::kFloat || bias->scalar_type() == torch::kBFloat16, "bias: fp32/bf16");
    e.bias = bias->data_ptr();
    e.bias_bf16 = bias->scalar_type() == torch::kBFloat16;
  }
}

// ---- AVX2: int4 / int8 x 8-bit activations on CPUs without AVX-512 BF16 ---------------------------
//
// The same layouts, activations and arithmetic as the q8 kernels above, 8 output rows per ymm: a
// 64-byte chunk is two ymm, rows 0..7 and 8..15. vpmaddubsw (unsigned codes x signed activations,
// pairs summed to int16) and vpmaddwd by ones stand in for vpdpbusd. Integer sums are exact, and the
// fp32 steps (quantization, group sums, scale and zero FMAs) are those of the AVX-512 kernels in the
// same order, so both give the same fp32 sums for the same inputs.

// An empty asm that takes and gives back v in a register: integer adds are associative, and without it
// GCC regroups a group's accumulation into a tree of partial products, each spilled to the stack.
VS_AVX2 inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// 8 bf16 values as fp32.
VS_AVX2 inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// quantize_groups for AVX2 CPUs: the same codes, scales, offsets and sums, bit for bit (the fp32 sum
// of 32 values follows _mm512_reduce_add_ps: x[i] + x[i + 16], then halves added down to one).
VS_AVX2 void quantize_groups_avx2(const uint16_t* x, int64_t rows, int64_t k, bool int4_order, int32_t bias,
                                  int8_t* xq, float* xscale, int32_t* offset, float* xsum) {
  const int64_t groups = k / GS;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(code_order[int4_order]));
  const __m256i dword_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* p = x + r * k + g * GS;
      const __m256 v0 = bf16x8(p), v1 = bf16x8(p + 8), v2 = bf16x8(p + 16), v3 = bf16x8(p + 24);
      const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                      _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
      const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
      // Saturating packs are exact (|code| <= 127); they interleave per 128-bit lane, dword_order undoes it.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3)), dword_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + g * GS), _mm256_shuffle_epi8(bytes, order));
      const int64_t i = r * groups + g;
      xscale[i] = amax / 127.0f;
      const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      offset[i] = -bias * _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      const __m256 t3 = _mm256_add_ps(_mm256_add_ps(v1, v3), _mm256_add_ps(v0, v2));
      const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
      const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, 0x4E));
      xsum[i] = _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
    }
  }
}

// One 16-row int4 block against MC rows of quantized x, as q8_block: per group the 8 vpmaddubsw of
// a row add up in int16 (|sum| <= 8 * 2 * 15 * 127 < 2^15), one vpmaddwd widens them. The fp32 sums
// stay in `out` ([MC][16], zeroed by the caller): sixteen ymm registers hold the integer ones only.
template <int MC>
VS_AVX2 inline void q8_block_avx2(const uint8_t* __restrict w, const uint32_t* __restrict sz,
                                  const int8_t* __restrict xq, int64_t ldx, const float* __restrict xscale,
                                  const int32_t* __restrict offset, const float* __restrict xsum, int64_t ldg,
                                  int64_t groups, float* __restrict out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a[MC][2];
    for (int m = 0; m < MC; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(sz + g * 16) + PREFETCH / 4, _MM_HINT_T0);
    // Half by half (rows 0..7, then 8..15), so that the live registers are the 2 * MC accumulators,
    // one half's codes and one row's activations: more would spill.
    for (int c = 0; c < 4; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + c * 64 + PREFETCH), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(d, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), nibble);
#pragma GCC unroll 4
        for (int m = 0; m < MC; ++m) {
          const int32_t* xp = reinterpret_cast<const int32_t*>(xq + m * ldx + g * GS + c * 8);
          a[m][h] = _mm256_add_epi16(a[m][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xp[0])));
          a[m][h] = _mm256_add_epi16(a[m][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xp[1])));
          keep_in_register(a[m][h]);
        }
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i s2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 16 + h * 8));
      const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(s2, 16));
      const __m256 zr = _mm256_castsi256_ps(_mm256_and_si256(s2, hi_mask));
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(a[m][h], ones), _mm256_set1_epi32(offset[m * ldg + g]));
        const __m256 s = _mm256_mul_ps(sc, _mm256_set1_ps(xscale[m * ldg + g]));
        float* y = out + m * BN + h * 8;
        __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, _mm256_loadu_ps(y));
        _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * ldg + g]), zr, v));
      }
    }
  }
}

// One 16-row int8 block against MC rows: a 64-byte line (pairs p, p + 1 of 16 rows) unpacks by words
// into rows {0-3, 8-11} and {4-7, 12-15}, four consecutive k per dword; signed x signed products go
// through vpmaddubsw as |q| times x with q's sign (|pair sum| <= 2 * 128 * 127 < 2^15). fp32 sums in
// `out` as for int4, in that row order (the caller's finish puts rows back in order).
template <int MC>
VS_AVX2 inline void q8_int8_block_avx2(const int8_t* __restrict w, const int8_t* __restrict xq, int64_t ldx,
                                       const float* __restrict xscale, int64_t ldg, int64_t groups,
                                       float* __restrict out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a[MC][2];
    for (int m = 0; m < MC; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const int8_t* wg = w + g * 512;
    for (int l = 0; l < 8; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + l * 64 + PREFETCH), _MM_HINT_T0);
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + l * 64));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + l * 64 + 32));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i t = h == 0 ? _mm256_unpacklo_epi16(p0, p1) : _mm256_unpackhi_epi16(p0, p1);
        const __m256i u = _mm256_abs_epi8(t);
#pragma GCC unroll 4
        for (int m = 0; m < MC; ++m) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * ldx + g * GS + l * 4));
          a[m][h] = _mm256_add_epi32(a[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(xv, t)), ones));
          keep_in_register(a[m][h]);
        }
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m)
      for (int h = 0; h < 2; ++h) {
        float* y = out + m * BN + h * 8;
        _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][h]), _mm256_set1_ps(xscale[m * ldg + g]),
                                            _mm256_loadu_ps(y)));
      }
  }
}

// All rows of a call against one block, QB rows per pass.
constexpr int QB = 4;

VS_AVX2 void q8_rows_avx2(const uint8_t* w, const uint32_t* sz, const Q8Activations& x, int64_t k, int64_t rows,
                          float* out) {
  const int64_t groups = k / GS;
  std::fill(out, out + rows * BN, 0.0f);
  for (int64_t m0 = 0; m0 < rows; m0 += QB) {
    const int64_t o = m0 * groups;
    const int8_t* xm = x.xq.data() + m0 * k;
    const float *xs = x.xscale.data() + o, *xt = x.xsum.data() + o;
    const int32_t* off = x.offset.data() + o;
    float* po = out + m0 * BN;
    switch (std::min<int64_t>(QB, rows - m0)) {
      case 1: q8_block_avx2<1>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 2: q8_block_avx2<2>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      case 3: q8_block_avx2<3>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
      default: q8_block_avx2<4>(w, sz, xm, k, xs, off, xt, groups, groups, po); break;
    }
  }
}

VS_AVX2 void q8_int8_rows_avx2(const int8_t* w, const Q8Activations& x, int64_t k, int64_t rows, float* out) {
  const int64_t groups = k / GS;
  std::fill(out, out + rows * BN, 0.0f);
  for (int64_t m0 = 0; m0 < rows; m0 += QB) {
    const int64_t o = m0 * groups;
    const int8_t* xm = x.xq.data() + m0 * k;
    const float* xs = x.xscale.data() + o;
    float* po = out + m0 * BN;
    switch (std::min<int64_t>(QB, rows - m0)) {
      case 1: q8_int8_block_avx2<1>(w, xm, k, xs, groups, groups, po); break;
      case 2: q8_int8_block_avx2<2>(w, xm, k, xs, groups, groups, po); break;
      case 3: q8_int8_block_avx2<3>(w, xm, k, xs, groups, groups, po); break;
      default: q8_int8_block_avx2<4>(w, xm, k, xs, groups, groups, po); break;
    }
  }
  // Rows {0-3, 8-11} | {4-7, 12-15} back to 0..7 | 8..15.
  for (int64_t m = 0; m < rows; ++m) {
    const __m256 a = _mm256_loadu_ps(out + m * BN), b = _mm256_loadu_ps(out + m * BN + 8);
    _mm256_storeu_ps(out + m * BN, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(out + m * BN + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
}

// Element j of an fp32 or bf16 array, as fp32.
inline float value_at(const void* p, bool bf16, int64_t j) {
  if (!bf16) return static_cast<const float*>(p)[j];
  const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[j]) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// finish_block for AVX2 CPUs (q8 calls: one split): row scale, bias, then fp32 or bf16 rounded as
// c10::BFloat16 rounds (nearest even, NaN -> 0x7FC0).
VS_AVX2 void finish_block_avx2(const Epilogue& e, const float* acc, int64_t n0) {
  const int valid = static_cast<int>(std::min<int64_t>(BN, e.n - n0));
  alignas(32) float scale[BN], bias[BN], v[BN];
  for (int i = 0; i < BN; ++i) {
    const int64_t j = n0 + std::min(i, valid - 1);
    scale[i] = e.scale ? value_at(e.scale, e.scale_bf16, j) : 1.0f;
    bias[i] = e.bias ? value_at(e.bias, e.bias_bf16, j) : 0.0f;
  }
  for (int64_t m = 0; m < e.rows; ++m) {
    for (int h = 0; h < 2; ++h) {
      __m256 t = _mm256_loadu_ps(acc + m * BN + 8 * h);
      if (e.scale) t = _mm256_mul_ps(t, _mm256_load_ps(scale + 8 * h));
      if (e.bias) t = _mm256_add_ps(t, _mm256_load_ps(bias + 8 * h));
      _mm256_store_ps(v + 8 * h, t);
    }
    char* dst = static_cast<char*>(e.y) + (m * e.ldy + n0) * (e.out_bf16 ? 2 : 4);
    if (e.out_bf16) {
      uint16_t* d = reinterpret_cast<uint16_t*>(dst);
      for (int i = 0; i < valid; ++i) d[i] = bf16_round(v[i]);
    } else {
      std::memcpy(dst, v, valid * sizeof(float));
    }
  }
}

// ---- entry points ------------------------------------------------------------------------------

// x: bf16 [M, K]; w: int4 layout above; sz: bf16 [N/16, K/32, 16, 2]. Returns [M, N] (fp32 or bf16).
// q8: x's rows quantized to 8 bits per group of 32 (AVX-512 VNNI or AVX2), else x as bf16.
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& sz, int64_t n,
                      const c10::optional<torch::Tensor>& bias, bool out_fp32, bool q8) {
  check_q8_cpu(q8);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % GS == 0 && n % BN == 0, "int4_mm: K % 32 == 0 and N % 16 == 0 required");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == n * k / 2, "int4_mm: packed w");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.numel() == n * (k / GS) * 2,
              "int4_mm: scales/zeros bf16 [N/16, K/32, 16, 2]");
  auto y = torch::empty({m, n}, x.options().dtype(out_fp32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0 || n == 0) return y;
  const int64_t groups = k / GS, blocks = n / BN;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const Q8Activations qx = q8 ? Q8Activations(xp, m, k, true, 8) : Q8Activations();
  std::vector<float> xs(q8 ? 0 : m * groups);  // the bf16 path's group sums
  if (!q8) group_sums(xp, m, k, xs.data());
  Epilogue e;
  e.n = n;
  e.rows = m;
  set_epilogue_out(e, y, bias);
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr());
  const bool wide = !q8 || q8_isa() == 512;  // AVX-512 kernels, else the AVX2 ones
  at::parallel_for(0, blocks, grain_for(k * BN / 2), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(m * BN);
    for (int64_t b = b0; b < b1; ++b) {
      if (!q8) {
        int4_rows(wp + b * (k * BN / 2), szp + b * groups * BN, xp, k, xs.data(), m, acc.data());
      } else if (wide) {
        q8_rows(wp + b * (k * BN / 2), szp + b * groups * BN, qx, k, m, acc.data());
      } else {
        q8_rows_avx2(wp + b * (k * BN / 2), szp + b * groups * BN, qx, k, m, acc.data());
      }
      (wide ? finish_block : finish_block_avx2)(e, acc.data(), b * BN);
    }
  });
  return y;
}

// Every 16-row block of an int8/bf16 weight against all rows of x, blocks split across threads.
template <class Tiles>
void pair_mm(const Epilogue& e, const typename Tiles::W* wp, const uint16_t* xp, int64_t k, int64_t rows,
             int64_t blocks) {
  at::parallel_for(0, blocks, grain_for(k * BN * static_cast<int64_t>(sizeof(typename Tiles::W))),
                   [&](int64_t b0, int64_t b1) {
                     std::vector<float> acc(rows * BN);
                     for (int64_t b = b0; b < b1; ++b) {
                       pair_rows<Tiles>(wp + b * k * BN, xp, k, rows, acc.data());
                       finish_block(e, acc.data(), b * BN);
                     }
                   });
}

// x: bf16 [splits * M, K] (rows s * M + m add up, e.g. the bf16 parts of fp32 activations);
// w: int8 layout above, [ceil(N/16), K/2, 16, 2]; scale: [N] fp32/bf16. Returns [M, N].
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale, int64_t n,
                      int64_t splits, const c10::optional<torch::Tensor>& bias, bool out_fp32, bool q8) {
  check_q8_cpu(q8);
  TORCH_CHECK(!q8 || (splits == 1 && x.size(1) % GS == 0), "int8_mm: q8 needs bf16 x (splits 1) and K % 32 == 0");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(splits >= 1 && x.size(0) % splits == 0, "int8_mm: rows not a multiple of splits");
  const int64_t rows = x.size(0), m = rows / splits, k = x.size(1);
  const int64_t blocks = (n + BN - 1) / BN;
  TORCH_CHECK(k % 2 == 0, "int8_mm: K must be even");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.numel() == blocks * BN * k, "int8_mm: packed w");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == n &&
                  (scale.scalar_type() == torch::kFloat || scale.scalar_type() == torch::kBFloat16),
              "int8_mm: scale fp32/bf16 [N]");
  auto y = torch::empty({m, n}, x.options().dtype(out_fp32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0 || n == 0) return y;
  Epilogue e;
  e.n = n;
  e.rows = m;
  e.splits = splits;
  e.scale = scale.data_ptr();
  e.scale_bf16 = scale.scalar_type() == torch::kBFloat16;
  set_epilogue_out(e, y, bias);
  const auto* wp = w.data_ptr<int8_t>();
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  if (!q8) {
    pair_mm<Int8Tiles>(e, wp, xp, k, rows, blocks);
    return y;
  }
  const Q8Activations qx(xp, m, k, false, 128);
  const bool wide = q8_isa() == 512;
  at::parallel_for(0, blocks, grain_for(k * BN), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(m * BN);
    for (int64_t b = b0; b < b1; ++b) {
      if (wide) {
        q8_int8_rows(wp + b * k * BN, qx, k, m, acc.data());
        finish_block(e, acc.data(), b * BN);
      } else {
        q8_int8_rows_avx2(wp + b * k * BN, qx, k, m, acc.data());
        finish_block_avx2(e, acc.data(), b * BN);
      }
    }
  });
  return y;
}


// x: bf16 [M, K]; w: bf16 layout above, [ceil(N/16), K/2, 16, 2]. Returns [M, N] (fp32 or bf16).
torch::Tensor bf16_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& bias,
                      bool out_fp32) {
  check_cpu();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = (n + BN - 1) / BN;
  TORCH_CHECK(k % 2 == 0, "bf16_mm: K must be even");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.numel() == blocks * BN * k,
              "bf16_mm: packed w");
  auto y = torch::empty({m, n}, x.options().dtype(out_fp32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0 || n == 0) return y;
  Epilogue e;
  e.n = n;
  e.rows = m;
  set_epilogue_out(e, y, bias);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  pair_mm<Bf16Tiles>(e, wp, xp, k, m, blocks);
  return y;
}

// ---- packing -------------------------------------------------------------------------------------


// 16 rows of codes (row r at codes + r * ldc, values 0..15) into one int4 block of k / 2 * 16 bytes.
void pack_int4_block(const uint8_t* codes, int64_t ldc, int64_t k, uint8_t* dst) {
  for (int64_t c = 0; c < k / 8; ++c) {
    uint8_t* d = dst + c * 64;
    for (int j = 0; j < 32; ++j) {
      const uint8_t* r = codes + (j >> 1) * ldc + c * 8 + (j & 1);
      d[2 * j] = static_cast<uint8_t>((r[0] & 15) | (r[2] & 15) << 4);
      d[2 * j + 1] = static_cast<uint8_t>((r[4] & 15) | (r[6] & 15) << 4);
    }
  }
}

void unpack_int4_block(const uint8_t* src, int64_t k, uint8_t* codes, int64_t ldc) {
  for (int64_t c = 0; c < k / 8; ++c) {
    const uint8_t* s = src + c * 64;
    for (int j = 0; j < 32; ++j) {
      uint8_t* r = codes + (j >> 1) * ldc + c * 8 + (j & 1);
      r[0] = s[2 * j] & 15;
      r[2] = s[2 * j] >> 4;
      r[4] = s[2 * j + 1] & 15;
      r[6] = s[2 * j + 1] >> 4;
    }
  }
}

// One 64-row block of PyTorch's AVX-512 int4 layout ([k][32] bytes, nibble i of a k-slice, low
// nibbles first, holding row rows_of_nibble[i]) into the four 16-row blocks of ours. `perm` is
// the inverse map (row -> nibble) as vpermb indices. Per 8 k: the 64 rows' codes of each k come
// out of one vpermb; bytes pairs of k interleave per 128-bit lane (= one 16-row block), and two
// shifts/ors and one more interleave give the 64-byte chunk of each block.
VS_AVX512_VBMI void stock64_to_fast(const uint8_t* blk, int64_t k, const uint8_t* perm, uint8_t* dst) {
  const __m512i idx = _mm512_loadu_si512(perm);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t bstride = k * BN / 2;  // bytes between our 16-row blocks
  for (int64_t c = 0; c < k / 8; ++c) {
    __m512i r[8];
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (c * 8 + t) * 32));
      const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                                 _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
      r[t] = _mm512_permutexvar_epi8(idx, nibbles);  // byte q = code of row q at k = 8c + t
    }
    // E_t[2q + s] = code(row q, k = 8c + 2t + s), per lane: lo = rows 0..7, hi = rows 8..15.
    __m512i elo[4], ehi[4];
    for (int t = 0; t < 4; ++t) {
      elo[t] = _mm512_unpacklo_epi8(r[2 * t], r[2 * t + 1]);
      ehi[t] = _mm512_unpackhi_epi8(r[2 * t], r[2 * t + 1]);
    }
    const __m512i flo = _mm512_or_si512(elo[0], _mm512_slli_epi16(elo[1], 4));
    const __m512i fhi = _mm512_or_si512(ehi[0], _mm512_slli_epi16(ehi[1], 4));
    const __m512i glo = _mm512_or_si512(elo[2], _mm512_slli_epi16(elo[3], 4));
    const __m512i ghi = _mm512_or_si512(ehi[2], _mm512_slli_epi16(ehi[3], 4));
    const __m512i out[4] = {_mm512_unpacklo_epi8(flo, glo), _mm512_unpackhi_epi8(flo, glo),
                            _mm512_unpacklo_epi8(fhi, ghi), _mm512_unpackhi_epi8(fhi, ghi)};
    for (int lane = 0; lane < 4; ++lane) {
      uint8_t* d = dst + lane * bstride + c * 64;
      for (int q = 0; q < 4; ++q) {
        __m128i part;
        switch (lane) {
          case 0: part = _mm512_extracti32x4_epi32(out[q], 0); break;
          case 1: part = _mm512_extracti32x4_epi32(out[q], 1); break;
          case 2: part = _mm512_extracti32x4_epi32(out[q], 2); break;
          default: part = _mm512_extracti32x4_epi32(out[q], 3); break;
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + q * 16), part);
      }
    }
  }
}

// int8 [16 rows (stride k), k] -> [k/2][16][2]: per 32 pairs, 16 row loads and two-level word permutes.
VS_AVX512 void int8_block_pack(const int8_t* src, int64_t k, int64_t rows, int8_t* dst) {
  const int64_t pairs = k / 2;
  auto* d = reinterpret_cast<uint32_t*>(dst);
  // A gather of 4 bytes (pairs 2*p2, 2*p2+1) from each of the 16 rows; even words are pair 2*p2.
  const __m512i vindex = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(k)));
  alignas(64) static const uint16_t sel_words[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                     1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i sel = _mm512_load_si512(sel_words);
  const __mmask16 live = rows >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
  int64_t p2 = 0;
  for (; 2 * p2 + 1 < pairs; ++p2) {
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vindex, src + 4 * p2, 1);
    _mm512_storeu_si512(d + p2 * 16, _mm512_permutexvar_epi16(sel, g));  // [pair 2p2: 16 rows | 2p2+1]
  }
  if (2 * p2 < pairs) {  // odd number of pairs: the last one alone
    const auto* s16 = reinterpret_cast<const uint16_t*>(src);
    auto* d16 = reinterpret_cast<uint16_t*>(dst) + 2 * p2 * 16;
    for (int64_t r = 0; r < 16; ++r) d16[r] = r < rows ? s16[r * pairs + 2 * p2] : 0;
  }
}

// codes: uint8 [N, K] (0..15) -> int4 layout, uint8 [N/16, K/2 * 16].
torch::Tensor int4_pack(const torch::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "codes: uint8 [N, K]");
  const auto c = codes.contiguous();
  const int64_t n = c.size(0), k = c.size(1);
  TORCH_CHECK(n % BN == 0 && k % GS == 0, "int4_pack: N % 16 == 0 and K % 32 == 0 required");
  auto out = torch::empty({n / BN, k * BN / 2}, c.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / BN, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) pack_int4_block(src + b * BN * k, k, k, dst + b * k * BN / 2);
  });
  return out;
}

torch::Tensor int4_unpack(const torch::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.numel() == n * k / 2, "int4_unpack: packed w");
  const auto p = packed.contiguous();
  auto out = torch::empty({n, k}, p.options());
  const uint8_t* src = p.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / BN, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) unpack_int4_block(src + b * k * BN / 2, k, dst + b * BN * k, k);
  });
  return out;
}

// From PyTorch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu): blocks of `bn` rows, each
// k / 2 ... laid out as [k][bn / 2] bytes whose nibble i (low nibbles first, then high) holds row
// rows_of_nibble[i]. Only whole blocks (n % bn == 0); the caller handles other shapes.
torch::Tensor int4_from_stock(const torch::Tensor& stock, int64_t n, int64_t k, const torch::Tensor& rows_of_nibble) {
  TORCH_CHECK(stock.scalar_type() == torch::kUInt8 && stock.numel() == n * k / 2, "int4_from_stock: packed w");
  TORCH_CHECK(rows_of_nibble.scalar_type() == torch::kLong && rows_of_nibble.dim() == 1, "rows_of_nibble: int64");
  const int64_t bn = rows_of_nibble.numel();
  TORCH_CHECK(bn % BN == 0 && n % bn == 0 && k % GS == 0, "int4_from_stock: shape/block mismatch");
  const auto s = stock.contiguous();
  const auto layout = rows_of_nibble.contiguous();
  std::vector<int64_t> nib_of_row(bn, -1);
  for (int64_t i = 0; i < bn; ++i) {
    const int64_t r = layout.data_ptr<int64_t>()[i];
    TORCH_CHECK(r >= 0 && r < bn && nib_of_row[r] < 0, "rows_of_nibble: not a permutation");
    nib_of_row[r] = i;
  }
  auto out = torch::empty({n / BN, k * BN / 2}, s.options());
  const uint8_t* src = s.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t half = bn / 2;
  if (bn == 64 && cpu_supported() && __builtin_cpu_supports("avx512vbmi")) {
    alignas(64) uint8_t perm[64];
    for (int64_t r = 0; r < 64; ++r) perm[r] = static_cast<uint8_t>(nib_of_row[r]);
    at::parallel_for(0, n / bn, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) stock64_to_fast(src + b * bn * k / 2, k, perm, dst + b * bn * k / 2);
    });
    return out;
  }
  at::parallel_for(0, n / bn, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> codes(bn * k);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = src + b * bn * k / 2;
      for (int64_t r = 0; r < bn; ++r) {
        const int64_t i = nib_of_row[r];
        const int64_t byte = i % half;
        const int shift = i >= half ? 4 : 0;
        uint8_t* cr = codes.data() + r * k;
        for (int64_t kk = 0; kk < k; ++kk) cr[kk] = (blk[kk * half + byte] >> shift) & 15;
      }
      for (int64_t r0 = 0; r0 < bn; r0 += BN)
        pack_int4_block(codes.data() + r0 * k, k, k, dst + (b * bn + r0) / BN * (k * BN / 2));
    }
  });
  return out;
}

// int8 [N, K] -> [ceil(N/16), K/2, 16, 2], rows padded with zeros.
// One 16-row block, row-major [rows, pairs] of k-pairs (a pair of int8 is 16 bits, of bf16 32)
// -> [pairs, 16], rows past `rows` zero: the kernels' tile layout.
template <class Pair>
void transpose_pairs(const Pair* s, int64_t rows, int64_t pairs, Pair* d) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t r = 0; r < BN; ++r) d[p * BN + r] = r < rows ? s[r * pairs + p] : 0;
}

torch::Tensor int8_pack(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.size(1) % 2 == 0, "q: int8 [N, K], K even");
  const auto c = q.contiguous();
  const int64_t n = c.size(0), k = c.size(1), blocks = (n + BN - 1) / BN, pairs = k / 2;
  auto out = torch::empty({blocks, pairs, BN, 2}, c.options());
  const int8_t* src = c.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  const bool simd = cpu_supported();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(BN, n - b * BN);
      if (simd) {
        int8_block_pack(src + b * BN * k, k, rows, dst + b * BN * k);
        continue;
      }
      transpose_pairs(reinterpret_cast<const uint16_t*>(src + b * BN * k), rows, pairs,
                      reinterpret_cast<uint16_t*>(dst + b * BN * k));
    }
  });
  return out;
}

// [ceil(N/16), K/2, 16, 2] -> [N, K]: the inverse of the pair transpose (either element type).
torch::Tensor pairs_unpack(const torch::Tensor& packed, int64_t n, int64_t k, c10::ScalarType type, const char* what) {
  const int64_t blocks = (n + BN - 1) / BN;
  TORCH_CHECK(packed.scalar_type() == type && packed.numel() == blocks * BN * k, what, ": packed w");
  return packed.contiguous().view({blocks, k / 2, BN, 2}).permute({0, 2, 1, 3}).reshape({blocks * BN, k}).narrow(0, 0, n)
      .contiguous();
}

torch::Tensor int8_unpack(const torch::Tensor& packed, int64_t n, int64_t k) {
  return pairs_unpack(packed, n, k, torch::kChar, "int8_unpack");
}

// bf16 [N, K] (K even) -> [ceil(N/16), K/2, 16, 2], rows padded with zeros: a transpose of 32-bit
// k-pairs per 16-row block (once, at load).
torch::Tensor bf16_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0, "w: bf16 [N, K], K even");
  const auto c = w.contiguous();
  const int64_t n = c.size(0), k = c.size(1), blocks = (n + BN - 1) / BN, pairs = k / 2;
  auto out = torch::empty({blocks, pairs, BN, 2}, c.options());
  const auto* src = reinterpret_cast<const uint32_t*>(c.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(BN, n - b * BN);
      transpose_pairs(src + b * BN * pairs, rows, pairs, dst + b * BN * pairs);
    }
  });
  return out;
}

// ---- dequantization to bf16 rows (prefill) ----------------------------------------------------
//
// For many activation rows (a prompt's prefill) the products are compute-bound, and oneDNN's
// bf16 GEMM beats the kernels above; the layers then expand the weight once per call into a
// temporary bf16 [N, K] with these functions and call F.linear. Each 16-row block is expanded
// 32 k at a time: 16 "pair tiles" (16 rows x 2 k, one dword per row, the kernels' operand) are
// computed in registers and transposed (16 x 16 dwords) into 16 row segments of 64 bytes.
// Values are computed in fp32 exactly as the Python reference does (Int4Weight.dequantize,
// Int8Weight.dequantize) and rounded to bf16 with PyTorch's own rounding (round to nearest even
// on the bits, denormals kept, NaN -> 0x7FC0), not vcvtneps2bf16 (which flushes denormals), so
// the result equals the reference's .to(torch.bfloat16) bit for bit.

// Dword r of every row of t[0..15] <-> dword t of row r: a 16 x 16 transpose of 32-bit elements.
VS_AVX512 inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Column c = 4L + j gathers lane L of r[j], r[4 + j], r[8 + j], r[12 + j].
  for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// fp32 -> bf16 as c10::BFloat16 rounds (nearest even on the bits; NaN -> 0x7FC0): the bf16 bits in
// the high half of each dword, the low half zero.
VS_AVX512 inline __m512i bf16_high(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// Two fp32 vectors of 16 -> one of 32 bf16: word 2i from even[i], word 2i + 1 from odd[i] (a pair tile).
VS_AVX512 inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  return _mm512_or_si512(_mm512_srli_epi32(bf16_high(even), 16), bf16_high(odd));
}

// Two fp32 vectors of 16 -> one of 32 bf16: words 0..15 from lo, 16..31 from hi.
VS_AVX512 inline __m512i bf16_concat(__m512 lo, __m512 hi) {
  alignas(64) static const uint16_t high_words[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                      23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                      45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_permutex2var_epi16(bf16_high(lo), _mm512_load_si512(high_words), bf16_high(hi));
}

// 16 transposed tiles -> 16 rows of 32 bf16 at dst (row stride ld), the first `rows` of them.
VS_AVX512 inline void store_rows(__m512i* t, uint16_t* dst, int64_t ld, int64_t rows) {
  transpose16x16(t);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_si512(dst + r * ld, t[r]);
}

// One int4 block (16 rows, layout of int4_block) -> bf16 rows: w = (q - 8) * scale + zero in fp32
// (the product is exact, so the FMA rounds once, as the reference's multiply then add does).
VS_AVX512 void int4_block_dequant(const uint8_t* w, const uint32_t* sz, int64_t k, uint16_t* dst) {
  const __m512i lut = _mm512_load_si512(lut_words);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t g = 0; g < k / GS; ++g) {
    const __m512i s2 = _mm512_loadu_si512(sz + g * 16);  // dword r: row r's (scale, zero)
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(s2, 16));
    const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(s2, hi_mask));
    __m512i t[16];
    for (int o = 0; o < 4; ++o) {
      const __m512i d = _mm512_loadu_si512(w + g * 256 + o * 64);
      for (int s = 0; s < 4; ++s) {  // word 2r + e, nibble s: row r, k = 32g + 8o + 2s + e
        const __m512i q = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4 * s), lut);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(q, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(q, hi_mask));
        t[4 * o + s] = bf16_pairs(_mm512_fmadd_ps(even, sc, zr), _mm512_fmadd_ps(odd, sc, zr));
      }
    }
    store_rows(t, dst + g * GS, k, BN);
  }
}

// One int8 block ([k/2][16][2], `rows` real rows) -> bf16 rows: w = q * scale[row] in fp32, as the reference.
VS_AVX512 void int8_block_dequant(const int8_t* w, const void* scale, bool scale_bf16, int64_t k, int64_t rows,
                                  uint16_t* dst) {
  alignas(64) float sc[BN] = {};
  const __m512 s16 = load16(scale, scale_bf16, static_cast<int>(rows));
  _mm512_store_ps(sc, s16);
  // Lane i of a pair tile's low / high 16 bytes is row i / 2 (rows 0..7) / 8 + i / 2.
  const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 sc_lo = _mm512_permutexvar_ps(lo_rows, s16);
  const __m512 sc_hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_rows, _mm512_set1_epi32(8)), s16);
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + 16 <= pairs; p += 16) {
    __m512i t[16];
    for (int i = 0; i < 16; ++i) {
      const int8_t* src = w + (p + i) * 32;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
      t[i] = bf16_concat(_mm512_mul_ps(lo, sc_lo), _mm512_mul_ps(hi, sc_hi));
    }
    store_rows(t, dst + 2 * p, k, rows);
  }
  for (; p < pairs; ++p)  // K not a multiple of 32
    for (int64_t r = 0; r < rows; ++r)
      for (int e = 0; e < 2; ++e) dst[r * k + 2 * p + e] = bf16_round(static_cast<float>(w[p * 32 + 2 * r + e]) * sc[r]);
}

// One bf16 block ([k/2][16][2]) -> rows: the tiles transposed as they are.
VS_AVX512 void bf16_block_unpack(const uint16_t* w, int64_t k, int64_t rows, uint16_t* dst) {
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + 16 <= pairs; p += 16) {
    __m512i t[16];
    for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(w + (p + i) * 32);
    store_rows(t, dst + 2 * p, k, rows);
  }
  for (; p < pairs; ++p)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * k + 2 * p, w + p * 32 + 2 * r, 4);
}

// Blocks per task: ~256 KiB of output, so a small layer stays on one thread.
int64_t dequant_grain(int64_t k) { return std::max<int64_t>(1, (256 << 10) / (BN * k * 2)); }

// The [N, K] bf16 result: `out` when given (a caller's reused buffer: a fresh tensor of tens of MiB
// costs its page faults on every call, about as much as writing it), else a new tensor.
torch::Tensor dequant_out(const c10::optional<torch::Tensor>& out, int64_t n, int64_t k, const torch::Tensor& like) {
  if (!out.has_value() || !out->defined()) return torch::empty({n, k}, like.options().dtype(torch::kBFloat16));
  TORCH_CHECK(out->scalar_type() == torch::kBFloat16 && out->is_contiguous() && out->dim() == 2 && out->size(0) == n &&
                  out->size(1) == k && out->device().is_cpu(),
              "dequant: out must be a contiguous CPU bf16 [N, K]");
  return *out;
}

// packed int4 (layout above) + sz bf16 [N/16, K/32, 16, 2] -> bf16 [N, K], (q - 8) * scale + zero.
torch::Tensor int4_dequant(const torch::Tensor& w, const torch::Tensor& sz, int64_t n, int64_t k,
                           const c10::optional<torch::Tensor>& out) {
  check_cpu();
  TORCH_CHECK(k % GS == 0 && n % BN == 0, "int4_dequant: K % 32 == 0 and N % 16 == 0 required");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == n * k / 2, "int4_dequant: packed w");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.numel() == n * (k / GS) * 2,
              "int4_dequant: scales/zeros bf16 [N/16, K/32, 16, 2]");
  auto y = dequant_out(out, n, k, w);
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / BN, dequant_grain(k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      int4_block_dequant(wp + b * (k * BN / 2), szp + b * (k / GS) * BN, k, yp + b * BN * k);
  });
  return y;
}

// packed int8 [ceil(N/16), K/2, 16, 2] + scale [N] (fp32/bf16) -> bf16 [N, K], q * scale.
torch::Tensor int8_dequant(const torch::Tensor& w, const torch::Tensor& scale, int64_t n, int64_t k,
                           const c10::optional<torch::Tensor>& out) {
  check_cpu();
  const int64_t blocks = (n + BN - 1) / BN;
  TORCH_CHECK(k % 2 == 0, "int8_dequant: K must be even");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.numel() == blocks * BN * k,
              "int8_dequant: packed w");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == n &&
                  (scale.scalar_type() == torch::kFloat || scale.scalar_type() == torch::kBFloat16),
              "int8_dequant: scale fp32/bf16 [N]");
  auto y = dequant_out(out, n, k, w);
  const auto* wp = w.data_ptr<int8_t>();
  const bool sbf16 = scale.scalar_type() == torch::kBFloat16;
  const auto* sp = static_cast<const char*>(scale.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, dequant_grain(k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      int8_block_dequant(wp + b * BN * k, sp + b * BN * (sbf16 ? 2 : 4), sbf16, k, std::min(BN, n - b * BN),
                         yp + b * BN * k);
  });
  return y;
}

// The bf16 [N, K] weight back from its packed layout (a copy): the tile transpose above, or a
// plain permute where this CPU cannot run it.
torch::Tensor bf16_unpack(const torch::Tensor& packed, int64_t n, int64_t k, const c10::optional<torch::Tensor>& out) {
  if (!cpu_supported()) {
    auto y = pairs_unpack(packed, n, k, torch::kBFloat16, "bf16_unpack");
    return out.has_value() && out->defined() ? dequant_out(out, n, k, packed).copy_(y) : y;
  }
  const int64_t blocks = (n + BN - 1) / BN;
  TORCH_CHECK(k % 2 == 0, "bf16_unpack: K must be even");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.numel() == blocks * BN * k, "bf16_unpack: packed w");
  const auto c = packed.contiguous();
  auto y = dequant_out(out, n, k, c);
  const auto* wp = reinterpret_cast<const uint16_t*>(c.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, dequant_grain(k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) bf16_block_unpack(wp + b * BN * k, k, std::min(BN, n - b * BN), yp + b * BN * k);
  });
  return y;
}
}  // namespace

// The matmuls as PyTorch operators too, so torch.compile keeps them in its graphs (the Python side
// registers their fake implementations). The namespace carries the build tag (VS_NS, set by the
// loader), so two builds in one process never clash.
#ifndef VS_NS
#define VS_NS verispec_wo_gemm
#endif

namespace VS_NS {
void register_small_ops(pybind11::module_& m);  // small_ops.cpp
bool cpu_runs_kernels() { return cpu_supported(); }  // small_ops.cpp checks the same CPU features
bool cpu_runs_avx2() { return cpu_supports_avx2(); }  // small_ops.cpp's fp32 ops where cpu_supported() fails
}

TORCH_LIBRARY(VS_NS, m) {
  m.def("int4_mm(Tensor x, Tensor w, Tensor sz, int n, Tensor? bias, bool out_fp32, bool q8=False) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor w, Tensor scale, int n, int splits, Tensor? bias, bool out_fp32, bool q8=False) "
        "-> Tensor");
  m.def("bf16_mm(Tensor x, Tensor w, int n, Tensor? bias, bool out_fp32) -> Tensor");
}

TORCH_LIBRARY_IMPL(VS_NS, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("bf16_mm", &bf16_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verispec weight-only int4/int8 and bf16 GEMM for small M (AVX-512 BF16)";
  m.def("cpu_supported", &cpu_supported, "whether this CPU runs the kernels (AVX-512 F/BW/VL/DQ/BF16)");
  m.def("cpu_supports_vnni", &cpu_supports_vnni, "whether this CPU also runs 8-bit activations (AVX-512 VNNI)");
  m.def("q8_isa", &q8_isa, "the kernels for 8-bit activations here: 512 (AVX-512 VNNI), 256 (AVX2) or 0");
  m.def("int4_mm", &int4_mm, "y = x @ dequant(w).T", py::arg("x"), py::arg("w"), py::arg("sz"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("out_fp32") = false, py::arg("q8") = false);
  m.def("int8_mm", &int8_mm, "y = x @ (q * scale).T", py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("n"),
        py::arg("splits") = 1, py::arg("bias") = py::none(), py::arg("out_fp32") = false, py::arg("q8") = false);
  m.def("bf16_mm", &bf16_mm, "y = x @ w.T", py::arg("x"), py::arg("w"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("out_fp32") = false);
  m.def("int4_pack", &int4_pack, "codes [N, K] -> int4 layout");
  m.def("int4_unpack", &int4_unpack, "int4 layout -> codes [N, K]");
  m.def("int4_from_stock", &int4_from_stock, "PyTorch CPU int4 layout -> int4 layout");
  m.def("int8_pack", &int8_pack, "int8 [N, K] -> int8 layout");
  m.def("int8_unpack", &int8_unpack, "int8 layout -> int8 [N, K]");
  m.def("bf16_pack", &bf16_pack, "bf16 [N, K] -> bf16 layout");
  m.def("bf16_unpack", &bf16_unpack, "bf16 layout -> bf16 [N, K]", py::arg("w"), py::arg("n"), py::arg("k"),
        py::arg("out") = py::none());
  m.def("int4_dequant", &int4_dequant, "int4 layout + scales/zeros -> bf16 [N, K]", py::arg("w"), py::arg("sz"),
        py::arg("n"), py::arg("k"), py::arg("out") = py::none());
  m.def("int8_dequant", &int8_dequant, "int8 layout + scale -> bf16 [N, K]", py::arg("w"), py::arg("scale"),
        py::arg("n"), py::arg("k"), py::arg("out") = py::none());
  VS_NS::register_small_ops(m);
}
