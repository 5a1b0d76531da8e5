// Fused rotary embedding for CPU tensors: one pass over x, math in float (or double), OpenMP over rows.
//
// Built by cpu_rope.py with the system C++ compiler and called through ctypes; it includes no torch header, so
// it builds in about a second. Rows are the three leading dims of a (n0, n1, n2, d) strided view; the row of
// cos/sin used by row (i0, i1, i2) is c0*i0 + c1*i1 + c2*p with p = pos[i0*ps0 + i2*ps2] (table mode) or i2.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

// The vector rows (float32 and the 16-bit types) use AVX-512 where the build CPU has it (-march=native), else AVX2
// with FMA and F16C; the portable loop and its integer conversions below serve every other CPU, and float64.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define POSENC_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define POSENC_AVX512_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define POSENC_AVX2 1
#include <immintrin.h>
#endif

namespace {

// 16-bit storage types, converted with integer arithmetic that the vectorizer handles (a f16 cast can
// become a scalar library call, 4x slower than memory on the CPUs we measured).
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float load(float v) { return v; }
inline double load(double v) { return v; }
inline float load(bf16 v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }
inline float load(f16 v) {
  // Shift the half's exponent and mantissa into float position and rescale by 2^112 (the bias difference);
  // subnormal halves instead go through a magic-number subtraction. Infinities and NaNs come out right
  // because 2^112 times the largest shifted exponent overflows to the float's all-ones exponent.
  const uint32_t w = static_cast<uint32_t>(v.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_to_float(sign | (two_w < (1u << 27) ? float_to_bits(subnormal) : float_to_bits(normal)));
}

template <typename T, typename C>
inline T store(C v);
template <>
inline float store<float, float>(float v) { return v; }
template <>
inline float store<float, double>(double v) { return static_cast<float>(v); }
template <>
inline double store<double, double>(double v) { return v; }
template <>
inline bf16 store<bf16, float>(float v) {
  // Round to nearest even, as torch does; a NaN stays a quiet NaN.
  const uint32_t u = float_to_bits(v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>(v != v ? ((u >> 16) | 0x40u) : rounded)};
}
template <>
inline bf16 store<bf16, double>(double v) { return store<bf16, float>(static_cast<float>(v)); }
template <>
inline f16 store<f16, float>(float v) {
  // Round to nearest even by adding a power of two that pushes the bits below the half's last mantissa bit
  // out of the float (the float addition does the rounding); overflow saturates to infinity through the
  // 2^112 * 2^-110 scaling, and a NaN stays a quiet NaN with its sign and the top of its payload, as vcvtps2ph
  // (the vector rows' conversion, and torch's) keeps them.
  const uint32_t w = float_to_bits(v);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float base = bits_to_float((bias >> 1) + 0x07800000u) + (__builtin_fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0x7E00u | ((w >> 13) & 0x03FFu);
  return f16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign))};
}
template <>
inline f16 store<f16, double>(double v) { return store<f16, float>(static_cast<float>(v)); }

// The lanes policy of a storage type (how its vectors convert to and from float), or void where the portable loop
// is used. Specialized below for the instructions the build CPU has.
template <typename T>
struct LanesOf {
  using type = void;
};

struct Args {
  const void* x;
  void* out;
  const void* cos;
  const void* sin;
  const int64_t* pos;
  int64_t n[3];
  int64_t d;
  int64_t half;
  int64_t xs[3];
  int64_t os[3];
  int64_t cs[3];
  int64_t ps[2];
  int32_t interleaved;
  int32_t conjugate;
  int32_t copy_tail;
  int32_t threads;
  int64_t rows;  // rows of the cos/sin table that pos indexes; last: an older revision given one job reads a prefix
};

#ifdef POSENC_AVX512
// AVX-512 rows for the 16-bit types. On this path the rotation is bound by instruction count rather than memory
// (an out-of-place call writes into freshly faulted pages that are already in cache), so each conversion is the
// fewest instructions that give torch's bits. gcc vectorizes the portable loop too, but its bf16 rounding
// costs about ten instructions per 16 values (the portable loop measured: bf16 forward 0.78x of a copy, fp16 0.65x).
//
// A lanes policy converts 16 values <-> one float vector: to_float(16 values in a __m256i),
// widen(32 values) -> two float vectors, pack(a, b) -> the 32 values of a then b, rounded to nearest even.
struct F16Lanes {
  // vcvtph2ps / vcvtps2ph are exact IEEE conversions (subnormals included, round to nearest even), as torch's.
  static __m512 to_float(__m256i v) { return _mm512_cvtph_ps(v); }
  static void widen(__m512i w, __m512& lo, __m512& hi) {
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
  }
  static void split_pairs(__m512i w, __m512& x1, __m512& x2) {
    x1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    x2 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
  }
  static __m256i narrow(__m512 f) { return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static __m512i pack(__m512 a, __m512 b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(narrow(a)), narrow(b), 1);
  }
};

struct BF16Lanes {
  // A bf16 is the high half of its float: one zero-masked vpermw moves 16 of them into place.
  static __m512i spread(int first) {
    alignas(64) int16_t index[32];
    for (int j = 0; j < 16; ++j) index[2 * j] = 0, index[2 * j + 1] = static_cast<int16_t>(first + j);
    return _mm512_load_si512(index);
  }
  static __m512 to_float(__m256i v) {
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread(0), _mm512_castsi256_si512(v)));
  }
  static void widen(__m512i w, __m512& lo, __m512& hi) {
    lo = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread(0), w));
    hi = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread(16), w));
  }
  static void split_pairs(__m512i w, __m512& x1, __m512& x2) {
    // A pair's 32-bit word holds x1 in its low half and x2 in its high half, which is already float position.
    x1 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    x2 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The portable store<bf16, float> on 16 lanes, up to the narrowing: each word's high half is its value rounded
  // to nearest even (u + 0x7FFF, plus 1 where the kept half is odd), a NaN's is its own with the quiet bit set.
  static __m512i biased(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
    r = _mm512_mask_add_epi32(r, _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000)), r, _mm512_set1_epi32(1));
    return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x00400000));
  }
  // a's 16 values then b's: one vpermt2w takes the high half of every word of both (index 2j + 1; bit 5 picks b),
  // where shifting and narrowing each vector (vpmovdw) took five shuffles for the two; the rounding's parity is a
  // masked add where it was a shift and an and. Built for x86-64-v4 on an Intel Xeon, bf16 in cache (s = 256) went
  // from 0.243 to 0.206 ms, at s = 4096 with reused buffers from 1.91 to 1.74 ms (3.24 to 2.74 in another run).
  static __m512i rounded(__m512 a, __m512 b) {
    alignas(64) int16_t index[32];
    for (int j = 0; j < 32; ++j) index[j] = static_cast<int16_t>(2 * j + 1);
    return _mm512_permutex2var_epi16(biased(a), _mm512_load_si512(index), biased(b));
  }
  static __m512i pack(__m512 a, __m512 b) {
#ifdef POSENC_AVX512_BF16
    // vcvtne2ps2bf16 rounds to nearest even and quiets NaNs as torch does, but flushes subnormal floats to zero
    // (torch keeps them). A flushed lane reads as +-0, so only steps with a zero result pay for the exact test,
    // and only steps with a subnormal one take the integer rounding.
    const __m512i r = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    if (__builtin_expect(_mm512_testn_epi16_mask(r, _mm512_set1_epi16(0x7FFF)) != 0, 0) &&
        (_mm512_fpclass_ps_mask(a, 0x20) | _mm512_fpclass_ps_mask(b, 0x20)) != 0)
      return rounded(a, b);
    return r;
#else
    // AVX-512 without BF16 (Skylake-X to Ice Lake servers): the integer rounding on every step, as the portable
    // loop does, but in these rows' whole-line steps (and with their streaming stores).
    return rounded(a, b);
#endif
  }
};

inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 fmsub(__m512 a, __m512 b, __m512 c) { return _mm512_fmsub_ps(a, b, c); }
#endif

// The portable row, from pair `first` on: any storage type, math in C.
template <typename T, typename C>
inline void rotate_row(const T* xr, T* orow, const C* c, const C* s, int64_t half, C sign, bool interleaved,
                       int64_t first = 0) {
  // In place, orow == xr: each pair is read before it is written and pairs are disjoint, so the vectorizer may
  // ignore the apparent aliasing.
  if (interleaved) {
#pragma GCC ivdep
    for (int64_t i = first; i < half; ++i) {
      const C x1 = load(xr[2 * i]), x2 = load(xr[2 * i + 1]), ci = c[i], si = sign * s[i];
      orow[2 * i] = store<T, C>(x1 * ci - x2 * si);
      orow[2 * i + 1] = store<T, C>(x2 * ci + x1 * si);
    }
  } else {
#pragma GCC ivdep
    for (int64_t i = first; i < half; ++i) {
      const C x1 = load(xr[i]), x2 = load(xr[i + half]), ci = c[i], si = sign * s[i];
      orow[i] = store<T, C>(x1 * ci - x2 * si);
      orow[i + half] = store<T, C>(x2 * ci + x1 * si);
    }
  }
}

#if defined(POSENC_AVX512) || defined(POSENC_AVX2)
inline __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 fmsub(__m256 a, __m256 b, __m256 c) { return _mm256_fmsub_ps(a, b, c); }

// (o1, o2) = (x1 cos - x2 sin, x2 cos + x1 sin), or with sin negated (the backward). The same roundings at every
// vector width, so AVX2 and AVX-512 builds give the same bits (apart from rows' last pairs in the portable loop).
template <bool Conj, typename V>
inline void rotate_pair(V x1, V x2, V c, V s, V& o1, V& o2) {
  if constexpr (Conj) {
    o1 = fmadd(x1, c, mul(x2, s));
    o2 = fmsub(x2, c, mul(x1, s));
  } else {
    o1 = fmsub(x1, c, mul(x2, s));
    o2 = fmadd(x2, c, mul(x1, s));
  }
}

// A vector store that bypasses the cache (non-temporal) when the call streams and the address allows it: see
// stream_jobs for when that pays.
inline void store_16_bytes(void* p, __m128i v, bool stream) {
  if (stream && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    _mm_stream_si128(static_cast<__m128i*>(p), v);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
  }
}
inline void store_32_bytes(void* p, __m256 v, bool stream) {
  if (stream && (reinterpret_cast<uintptr_t>(p) & 31) == 0) {
    _mm256_stream_ps(static_cast<float*>(p), v);
  } else {
    _mm256_storeu_ps(static_cast<float*>(p), v);
  }
}
inline void fence_streams() { _mm_sfence(); }
#else
inline void fence_streams() {}
#endif

#ifdef POSENC_AVX512
inline void store_64_bytes(void* p, __m512i v, bool stream) {
  if (stream && (reinterpret_cast<uintptr_t>(p) & 63) == 0) {
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  } else {
    _mm512_storeu_si512(p, v);
  }
}
inline void store_64_bytes(void* p, __m512 v, bool stream) { store_64_bytes(p, _mm512_castps_si512(v), stream); }
#endif

#if defined(POSENC_AVX512) || defined(POSENC_AVX2)
// float32 vectors of a width in bits, as the float32 rows below use them (an int, not the vector type, picks one:
// vector types lose their attributes as template arguments).
template <int Bits>
struct F32Vec;
template <>
struct F32Vec<256> {
  using V = __m256;
  static constexpr int64_t lanes = 8;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, __m256 v, bool stream) { store_32_bytes(p, v, stream); }
  static __m256 spread(const float* p) {  // lanes / 2 values, each to both lanes of its pair
    const __m256i index = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), index);
  }
  static __m256 swap_pairs(__m256 v) { return _mm256_permute_ps(v, 0xB1); }
  static __m256 fmaddsub(__m256 a, __m256 b, __m256 c) { return _mm256_fmaddsub_ps(a, b, c); }
  static __m256 fmsubadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmsubadd_ps(a, b, c); }
};
#ifdef POSENC_AVX512
template <>
struct F32Vec<512> {
  using V = __m512;
  static constexpr int64_t lanes = 16;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 v, bool stream) { store_64_bytes(p, v, stream); }
  static __m512 spread(const float* p) {
    const __m512i index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(index, _mm512_castps256_ps512(_mm256_loadu_ps(p)));
  }
  static __m512 swap_pairs(__m512 v) { return _mm512_permute_ps(v, 0xB1); }
  static __m512 fmaddsub(__m512 a, __m512 b, __m512 c) { return _mm512_fmaddsub_ps(a, b, c); }
  static __m512 fmsubadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmsubadd_ps(a, b, c); }
};
constexpr int kWidestBits = 512;
#else
constexpr int kWidestBits = 256;
#endif

// float32 rows from pair `first` on: steps of Bits-wide vectors, then of 256-bit ones, then the portable loop for
// the last pairs. gcc vectorizes the portable loop, but pays a prologue and an epilogue on every row of a few
// vector steps (split halves with recycled buffers: 0.84 -> 0.90 of a copy), does worse on interleaved pairs
// (0.73, against 0.96 split) and never streams. An interleaved step spreads cos/sin to both lanes of their pair:
// fmaddsub gives x1 cos - x2 sin in even lanes and x2 cos + x1 sin in odd ones, with the split steps' roundings
// (the product with sin rounded first), as fmsubadd gives the conjugate.
template <int Bits, bool Interleaved, bool Conj>
inline void rotate_row_f32(const float* xr, float* orow, const float* c, const float* s, int64_t half, bool stream,
                           int64_t first = 0) {
  using F = F32Vec<Bits>;
  using V = typename F::V;
  constexpr int64_t pairs = Interleaved ? F::lanes / 2 : F::lanes;
  int64_t i = first;
  for (; i + pairs <= half; i += pairs) {
    if constexpr (Interleaved) {
      const V x = F::load(xr + 2 * i), ci = F::spread(c + i);
      const V partner_sin = mul(F::swap_pairs(x), F::spread(s + i));  // (x2 sin, x1 sin) per pair
      F::store(orow + 2 * i, Conj ? F::fmsubadd(x, ci, partner_sin) : F::fmaddsub(x, ci, partner_sin), stream);
    } else {
      V o1, o2;
      rotate_pair<Conj>(F::load(xr + i), F::load(xr + i + half), F::load(c + i), F::load(s + i), o1, o2);
      F::store(orow + i, o1, stream);
      F::store(orow + i + half, o2, stream);
    }
  }
  if constexpr (F::lanes > 8) {
    rotate_row_f32<256, Interleaved, Conj>(xr, orow, c, s, half, stream, i);
  } else if (i < half) {
    rotate_row<float, float>(xr, orow, c, s, half, Conj ? -1.0f : 1.0f, Interleaved, i);
  }
}
#endif

#ifdef POSENC_AVX512

// Split-half rows, 32 pairs per step: whole 64-byte loads and stores of x1, x2, o1 and o2.
template <typename Lanes, bool Conj>
inline void rotate_split_32(const uint16_t* xr, uint16_t* orow, const float* c, const float* s, int64_t i,
                            int64_t half, bool stream) {
  __m512 x1a, x1b, x2a, x2b, o1a, o1b, o2a, o2b;
  Lanes::widen(_mm512_loadu_si512(xr + i), x1a, x1b);
  Lanes::widen(_mm512_loadu_si512(xr + i + half), x2a, x2b);
  rotate_pair<Conj>(x1a, x2a, _mm512_loadu_ps(c + i), _mm512_loadu_ps(s + i), o1a, o2a);
  rotate_pair<Conj>(x1b, x2b, _mm512_loadu_ps(c + i + 16), _mm512_loadu_ps(s + i + 16), o1b, o2b);
  store_64_bytes(orow + i, Lanes::pack(o1a, o1b), stream);
  store_64_bytes(orow + i + half, Lanes::pack(o2a, o2b), stream);
}

// 16 pairs at pair index i: every interleaved step, and split-half rows' last steps. Only a row's last partial
// step is masked; full steps use plain loads and stores.
template <typename Lanes, bool Interleaved, bool Conj, bool Masked>
inline void rotate_step_16(const uint16_t* xr, uint16_t* orow, const float* c, const float* s, int64_t i,
                           int64_t half, __mmask16 m, bool stream) {
  __m512 ci, si, x1, x2, o1, o2;
  if constexpr (Masked) {
    ci = _mm512_maskz_loadu_ps(m, c + i);
    si = _mm512_maskz_loadu_ps(m, s + i);
    if constexpr (Interleaved) {
      Lanes::split_pairs(_mm512_maskz_loadu_epi32(m, xr + 2 * i), x1, x2);
    } else {
      x1 = Lanes::to_float(_mm256_maskz_loadu_epi16(m, xr + i));
      x2 = Lanes::to_float(_mm256_maskz_loadu_epi16(m, xr + i + half));
    }
  } else {
    ci = _mm512_loadu_ps(c + i);
    si = _mm512_loadu_ps(s + i);
    if constexpr (Interleaved) {
      Lanes::split_pairs(_mm512_loadu_si512(xr + 2 * i), x1, x2);
    } else {
      x1 = Lanes::to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i)));
      x2 = Lanes::to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i + half)));
    }
  }
  rotate_pair<Conj>(x1, x2, ci, si, o1, o2);
  const __m512i out = Lanes::pack(o1, o2);
  if constexpr (Interleaved) {
    // 16-bit lane 2p of the output takes o1[p] (the low 256 bits of the pack), lane 2p+1 takes o2[p].
    const __m512i weave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i woven = _mm512_permutexvar_epi16(weave, out);
    if constexpr (Masked) {
      _mm512_mask_storeu_epi32(orow + 2 * i, m, woven);
    } else {
      store_64_bytes(orow + 2 * i, woven, stream);
    }
  } else if constexpr (Masked) {
    _mm256_mask_storeu_epi16(orow + i, m, _mm512_castsi512_si256(out));
    _mm256_mask_storeu_epi16(orow + i + half, m, _mm512_extracti64x4_epi64(out, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + i), _mm512_castsi512_si256(out));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + i + half), _mm512_extracti64x4_epi64(out, 1));
  }
}

template <typename Lanes, bool Interleaved, bool Conj, typename T>
inline void rotate_row_16bit(const T* x, T* out, const float* c, const float* s, int64_t half, bool stream) {
  const auto* xr = reinterpret_cast<const uint16_t*>(x);
  auto* orow = reinterpret_cast<uint16_t*>(out);
  int64_t i = 0;
  if constexpr (!Interleaved) {
    for (; i + 32 <= half; i += 32) rotate_split_32<Lanes, Conj>(xr, orow, c, s, i, half, stream);
  }
  for (; i + 16 <= half; i += 16) rotate_step_16<Lanes, Interleaved, Conj, false>(xr, orow, c, s, i, half, 0, stream);
  if (i < half) {
    const auto m = static_cast<__mmask16>((1u << (half - i)) - 1);
    rotate_step_16<Lanes, Interleaved, Conj, true>(xr, orow, c, s, i, half, m, stream);
  }
}
#endif

#ifdef POSENC_AVX2
// AVX2 + F16C rows for the 16-bit types (CPUs without AVX-512). gcc does not vectorize the portable fp16
// conversions for AVX2 (fp16 ran at 0.07x of a copy, bf16 0.49x, recycled buffers), so these are written out:
// 8 pairs per step (bf16: 16 on split halves, 8 as whole 32-byte vectors on adjacent pairs), the same roundings as
// the AVX-512 rows, and the portable loop for a row's last pairs.
// A lanes policy converts 8 values <-> one float vector: to_float(8 values in a __m128i), and narrow_store(a, b,
// pa, pb, store) a step's two outputs of 8 floats each, stored at pa and pb (bf16 tests both for NaNs at once).
// kWholeVectors: it also converts whole 32-byte vectors (widen, table and narrow for split halves, split_pairs and
// weave for adjacent pairs), and the rows take those steps first.
struct F16Lanes {
  static constexpr bool kWholeVectors = false;  // vcvtph2ps widens 8 values from 16 bytes
  static __m256 to_float(__m128i v) { return _mm256_cvtph_ps(v); }
  template <typename Store>
  static void narrow_store(__m256 a, __m256 b, uint16_t* pa, uint16_t* pb, Store store) {
    store(pa, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    store(pb, _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
struct BF16Lanes {
  // A bf16 is its float's high half, so whole 32-byte vectors of them widen and narrow within 128-bit lanes:
  // split halves take 16 pairs a step instead of 8, and adjacent pairs (one 32-bit word each) are split and woven
  // back by shifts and blends, where the 8-value steps that F16C's conversions shape spent about half their
  // instructions moving values between 128-bit halves.
  // On Zen 1 (one pipe for vector shifts) shifts made the 8-pair steps compute-bound; without them an in-cache call
  // took 0.355 ms instead of 0.45 (docs/benchmarks.md, "A fourth machine"). These steps shift once per vector to
  // round and twice more per adjacent-pair step: measured on Zen 3 only ("A fifth machine").
  static constexpr bool kWholeVectors = true;
  // Split halves: 16 values -> floats in the lane order (0-3, 8-11) and (4-7, 12-15); table() loads cos/sin in it.
  static void widen(__m256i v, __m256& lo, __m256& hi) {
    const __m256i zero = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
  static void table(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm_loadu_ps(p + 8), 1);
    hi = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + 4)), _mm_loadu_ps(p + 12), 1);
  }
  // The inverse of widen: 16 bf16 in order.
  static __m256i narrow(__m256 lo, __m256 hi) {
    __m256i rl, rh;
    round_both(lo, hi, rl, rh);
    const __m256i upper = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1,
                                           -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_or_si256(_mm256_shuffle_epi8(rl, lower_of_lanes()), _mm256_shuffle_epi8(rh, upper));
  }
  // Adjacent pairs: a pair's 32-bit word holds x1 in its low half and x2 in its high half (float position).
  static void split_pairs(__m256i w, __m256& x1, __m256& x2) {
    x1 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    x2 = _mm256_castsi256_ps(_mm256_blend_epi16(_mm256_setzero_si256(), w, 0xAA));
  }
  static __m256i weave(__m256 o1, __m256 o2) {
    __m256i r1, r2;
    round_both(o1, o2, r1, r2);
    return _mm256_blend_epi16(_mm256_srli_epi32(r1, 16), r2, 0xAA);
  }
  // 8 values (the 8-pair steps of a split row's last pairs).
  static __m256 to_float(__m128i v) {
    const __m128i zero = _mm_setzero_si128();
    return _mm256_castsi256_ps(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(zero, v)), _mm_unpackhi_epi16(zero, v), 1));
  }
  template <typename Store>
  static void narrow_store(__m256 a, __m256 b, uint16_t* pa, uint16_t* pb, Store store) {
    __m256i ra, rb;
    round_both(a, b, ra, rb);
    store(pa, high_halves(ra));
    store(pb, high_halves(rb));
  }

 private:
  // The portable store<bf16, float> on 8 lanes, before taking the high halves: round to nearest even, u + 0x7FFF
  // + odd, the addend 0x8000 chosen where bit 16 (the kept half's last bit, shifted to the sign for the blend) is
  // odd; a NaN truncated with its quiet bit set (quieted). Three operations where a compare for the parity took
  // four: in cache (Zen 3, s = 256) 0.160 -> 0.154 ms split, 0.137 -> 0.126 ms adjacent pairs (docs/benchmarks.md,
  // "A fifth machine"). Checked against the portable rounding for all 2^32 floats.
  static __m256i rounded(__m256i u) {
    const __m256 odd_sign = _mm256_castsi256_ps(_mm256_slli_epi32(u, 15));
    const __m256 addend = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF)),
                                           _mm256_castsi256_ps(_mm256_set1_epi32(0x8000)), odd_sign);
    return _mm256_add_epi32(u, _mm256_castps_si256(addend));
  }
  static __m256i quieted(__m256i r, __m256 f) {
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_castps_si256(f), _mm256_set1_epi32(0x400000)), nan);
  }
  static void round_both(__m256 a, __m256 b, __m256i& ra, __m256i& rb) {
    ra = rounded(_mm256_castps_si256(a));
    rb = rounded(_mm256_castps_si256(b));
    // One unordered compare finds a NaN in either vector; the blends run only then.
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0, 0)) {
      ra = quieted(ra, a);
      rb = quieted(rb, b);
    }
  }
  // Each 128-bit lane's high halves into its low 8 bytes, zeros above.
  static __m256i lower_of_lanes() {
    return _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1,
                            -1, -1, -1, -1, -1, -1, -1);
  }
  static __m128i high_halves(__m256i r) {
    r = _mm256_shuffle_epi8(r, lower_of_lanes());
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
};
template <typename Lanes, bool Interleaved, bool Conj, typename T>
inline void rotate_row_16bit(const T* x, T* out, const float* c, const float* s, int64_t half, bool stream) {
  const auto* xr = reinterpret_cast<const uint16_t*>(x);
  auto* orow = reinterpret_cast<uint16_t*>(out);
  auto load8 = [](const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  auto store8 = [stream](uint16_t* p, __m128i v) { store_16_bytes(p, v, stream); };
  int64_t i = 0;
  __m256 o1, o2;
  if constexpr (Lanes::kWholeVectors) {
    auto load32 = [](const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    auto store32 = [stream](uint16_t* p, __m256i v) { store_32_bytes(p, _mm256_castsi256_ps(v), stream); };
    if constexpr (Interleaved) {
      for (; i + 8 <= half; i += 8) {
        __m256 x1, x2;
        Lanes::split_pairs(load32(xr + 2 * i), x1, x2);
        rotate_pair<Conj>(x1, x2, _mm256_loadu_ps(c + i), _mm256_loadu_ps(s + i), o1, o2);
        store32(orow + 2 * i, Lanes::weave(o1, o2));
      }
    } else {
      for (; i + 16 <= half; i += 16) {
        __m256 x1a, x1b, x2a, x2b, ca, cb, sa, sb, o1b, o2b;
        Lanes::widen(load32(xr + i), x1a, x1b);
        Lanes::widen(load32(xr + i + half), x2a, x2b);
        Lanes::table(c + i, ca, cb);
        Lanes::table(s + i, sa, sb);
        rotate_pair<Conj>(x1a, x2a, ca, sa, o1, o2);
        rotate_pair<Conj>(x1b, x2b, cb, sb, o1b, o2b);
        store32(orow + i, Lanes::narrow(o1, o1b));
        store32(orow + i + half, Lanes::narrow(o2, o2b));
      }
    }
  }
  for (; i + 8 <= half; i += 8) {
    if constexpr (Interleaved) {
      // fp16 only (bf16's adjacent pairs took whole vectors above). Pairs 0..3 widen into f0 and 4..7 into f1; the
      // in-lane shuffles leave x1 and x2 in pair order 0 1 4 5 2 3 6 7, so cos/sin are loaded in that order too, and
      // unpacking o1 with o2 lane by lane restores pairs 0..3 and 4..7 without a cross-lane step.
      const __m256 f0 = Lanes::to_float(load8(xr + 2 * i)), f1 = Lanes::to_float(load8(xr + 2 * i + 8));
      const __m256 x1 = _mm256_shuffle_ps(f0, f1, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 x2 = _mm256_shuffle_ps(f0, f1, _MM_SHUFFLE(3, 1, 3, 1));
      auto mixed = [](const float* p) {
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_loadu_ps(p)), _MM_SHUFFLE(3, 1, 2, 0)));
      };
      rotate_pair<Conj>(x1, x2, mixed(c + i), mixed(s + i), o1, o2);
      Lanes::narrow_store(_mm256_unpacklo_ps(o1, o2), _mm256_unpackhi_ps(o1, o2), orow + 2 * i, orow + 2 * i + 8,
                          store8);
    } else {
      rotate_pair<Conj>(Lanes::to_float(load8(xr + i)), Lanes::to_float(load8(xr + i + half)), _mm256_loadu_ps(c + i),
                        _mm256_loadu_ps(s + i), o1, o2);
      Lanes::narrow_store(o1, o2, orow + i, orow + i + half, store8);
    }
  }
  if (i < half) rotate_row<T, float>(x, out, c, s, half, Conj ? -1.0f : 1.0f, Interleaved, i);
}
#endif

#if defined(POSENC_AVX512) || defined(POSENC_AVX2)
// Each build defines one F16Lanes and one BF16Lanes, at its vector width.
template <>
struct LanesOf<f16> {
  using type = F16Lanes;
};
template <>
struct LanesOf<bf16> {
  using type = BF16Lanes;
};
#endif

// The loop over rows; row(x_row, out_row, cos_row, sin_row) rotates one. Row kernels are chosen once per call, so
// the per-row work is the address arithmetic below (a row of d = 128 bf16 is only two vector steps).
template <typename T, typename C, typename Row>
void rotate_rows(const Args& args, bool stream, Row row) {
  // Work items are (i0, block of BLOCK positions along dim 2, i1): the cos/sin rows of one block stay in cache
  // while every head (dim 1) uses them, instead of being streamed once per head.
  constexpr int64_t BLOCK = 32;
  // Where a thread owns whole heads it walks them a chunk of positions at a time, each group of heads' rows of a
  // chunk in order (groups: below): the chunk's cos/sin (at most CHUNK_TABLE_BYTES) stay in cache for all the
  // heads, and the output is written in runs of up to a huge page. Block by block across the heads instead, a 2 MiB
  // huge page of fresh output is faulted in (zeroed) long before most of its lines are written, which reads them
  // back from memory: with huge pages, fresh output, s = 4096, that order ran at 0.72 (fp32) and 0.81 (bf16) of a
  // copy, against 0.90 and 0.95 in chunks (Zen 4). Whole heads with no chunks lost at s = 32768 (bf16 fresh, 4 KiB
  // pages: 0.78 against 0.96), where the tables (16 MiB) are read again for every head. Chunks of 256 KiB, which
  // stay in L2, won on an Intel Xeon whose L3 holds q and k (reused buffers, s = 4096, bf16 0.54 -> 0.74 of a copy)
  // while each head read its own tables; with heads in groups the size no longer mattered there (reused bf16
  // 0.78-0.82 from 64 KiB to 16 MiB), and 4 MiB did better with huge pages (fresh bf16 0.84-0.92 against 0.75-0.88
  // for 256 KiB, three runs; docs/benchmarks.md, "The Intel Xeon again").
  constexpr int64_t CHUNK_TABLE_BYTES = int64_t(4) << 20;
  constexpr int64_t GROUP = 4;
  const int64_t blocks = (args.n[2] + BLOCK - 1) / BLOCK;
  const int64_t block_table_bytes = std::max<int64_t>(2 * args.half * int64_t(sizeof(C)) * BLOCK, 1);
  const int64_t chunk = std::max<int64_t>(CHUNK_TABLE_BYTES / block_table_bytes, 1);  // blocks per chunk
  const int64_t items = args.n[0] * blocks * args.n[1];
#pragma omp parallel num_threads(args.threads)
  {
    // Each thread's own copy of the arguments: the vector stores may alias any memory, and a shared struct would
    // be reloaded after every row.
    const Args a = args;
    const T* x = static_cast<const T*>(a.x);
    T* out = static_cast<T*>(a.out);
    const C* cos_ = static_cast<const C*>(a.cos);
    const C* sin_ = static_cast<const C*>(a.sin);
    const int64_t n1 = a.n[1], n2 = a.n[2], tail = a.d - 2 * a.half, row_bytes = a.d * int64_t(sizeof(T));
    const int64_t x_head = a.xs[1] * int64_t(sizeof(T));  // bytes from one head's row to the next's
    const bool copy_tail = a.copy_tail && tail > 0;
    // This thread's items, in order. Where the (i0, i1) lanes split evenly enough between the threads, each thread
    // owns a contiguous run of lanes and walks it chunk by chunk, so the threads write memory far apart (bf16 at
    // s = 4096: 0.90 -> 0.92 of a copy with fresh pages, 1.02 -> 1.04 reused); otherwise a static split of the items.
    const int64_t lanes = a.n[0] * n1, nt = omp_get_num_threads(), t = omp_get_thread_num();
    const bool by_lane = lanes % nt == 0 || lanes >= 8 * nt;
    const int64_t total = by_lane ? lanes : items, lo = total * t / nt, hi = total * (t + 1) / nt;
    // Owning whole lanes, a thread walks them in groups of up to GROUP heads of one i0, position by position, each
    // head's row at that position in turn: where the heads share a table (cs[1] == 0) the group's rows read the
    // same cos/sin row, which the first of them brings into L1. One head at a time, every row read its cos/sin
    // from L2: for bf16 that is twice the row's own bytes, and on an Intel Xeon with q and k in its L3 (s = 4096,
    // reused buffers) it cost about 0.15 of a copy (a diagnostic build with one table row for every position ran
    // at 0.91 against 0.77). group_start holds each group's first lane, then hi.
    std::vector<int64_t> group_start;
    if (by_lane) {
      for (int64_t lane = lo; lane < hi;) {
        group_start.push_back(lane);
        lane = a.cs[1] == 0 ? std::min({lane + GROUP, hi, (lane / n1 + 1) * n1}) : lane + 1;
      }
      group_start.push_back(hi);
    }
    const int64_t groups = by_lane ? int64_t(group_start.size()) - 1 : 0;
    const int64_t count = by_lane ? groups * blocks : hi - lo;
    // Item k: `width` lanes from (i0, i1) on (consecutive heads of one i0), the positions of block blk.
    auto locate = [&](int64_t k, int64_t& i0, int64_t& i1, int64_t& width, int64_t& blk) {
      if (by_lane) {
        // Chunk c holds blocks [first, first + nb) of every group: groups * nb items, group-major.
        const int64_t c = k / (groups * chunk), r = k % (groups * chunk), first = c * chunk;
        const int64_t nb = std::min(chunk, blocks - first), g = r / nb, lane = group_start[g];
        blk = first + r % nb, i0 = lane / n1, i1 = lane % n1, width = group_start[g + 1] - lane;
      } else {
        const int64_t item = lo + k;
        i1 = item % n1, blk = (item / n1) % blocks, i0 = item / (n1 * blocks), width = 1;
      }
    };
    for (int64_t k = 0; k < count; ++k) {
      int64_t i0, i1, width, blk;
      locate(k, i0, i1, width, blk);
      const int64_t start = blk * BLOCK, end = (blk + 1) * BLOCK < n2 ? (blk + 1) * BLOCK : n2;
      const T* xr = x + i0 * a.xs[0] + i1 * a.xs[1] + start * a.xs[2];
      T* orow = out + i0 * a.os[0] + i1 * a.os[1] + start * a.os[2];
      const int64_t ch = i0 * a.cs[0] + i1 * a.cs[1];  // the same for every lane of the item (cs[1] == 0)
      const int64_t* ph = a.pos ? a.pos + i0 * a.ps[0] : nullptr;
      // Each item fetches the next item's rows of x. The hardware prefetchers lose the stream where that is a jump
      // away (another head), and with fresh output at every page fault. Measured 0.84 -> 0.92 of a copy (bf16,
      // block order); in chunks, fresh output, 0.84 -> 0.92 (bf16) and 0.86 -> 0.95 (fp32), reused within 0.06.
      const char* next = nullptr;
      int64_t next_rows = 0, next_width = 0;
      if (k + 1 < count) {
        int64_t j0, j1, jblk;
        locate(k + 1, j0, j1, next_width, jblk);
        next = reinterpret_cast<const char*>(x + j0 * a.xs[0] + j1 * a.xs[1] + jblk * BLOCK * a.xs[2]);
        next_rows = ((jblk + 1) * BLOCK < n2 ? (jblk + 1) * BLOCK : n2) - jblk * BLOCK;
      }
      for (int64_t i2 = start; i2 < end; ++i2, xr += a.xs[2], orow += a.os[2]) {
        if (i2 - start < next_rows) {
          const char* ahead = next + (i2 - start) * a.xs[2] * int64_t(sizeof(T));
          for (int64_t j = 0; j < next_width; ++j, ahead += x_head)
            for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte, 0, 2);
        }
        const int64_t co = ch + (ph ? ph[i2 * a.ps[1]] : i2) * a.cs[2];
        for (int64_t j = 0; j < width; ++j) {
          const T* xj = xr + j * a.xs[1];
          T* oj = orow + j * a.os[1];
          row(xj, oj, cos_ + co, sin_ + co);
          if (copy_tail) std::memcpy(oj + 2 * a.half, xj + 2 * a.half, tail * sizeof(T));
        }
      }
    }
    // Streamed stores are weakly ordered: each thread drains its own before the region's closing barrier.
    if (stream) fence_streams();
  }
}

template <typename T, typename C>
void rotate(const Args& a, bool stream) {
  const int64_t half = a.half;
#if defined(POSENC_AVX512) || defined(POSENC_AVX2)
  using Lanes = typename LanesOf<T>::type;
  if constexpr (std::is_same_v<C, float> && (std::is_same_v<T, float> || !std::is_void_v<Lanes>)) {
    // The flags become template arguments, so each row kernel is compiled for one layout and direction.
    auto run = [&](auto interleaved, auto conj) {
      constexpr bool I = decltype(interleaved)::value, Cj = decltype(conj)::value;
      rotate_rows<T, C>(a, stream, [half, stream](const T* xr, T* orow, const C* c, const C* s) {
        if constexpr (std::is_same_v<T, float>) {
          rotate_row_f32<kWidestBits, I, Cj>(xr, orow, c, s, half, stream);
        } else {
          rotate_row_16bit<Lanes, I, Cj>(xr, orow, c, s, half, stream);
        }
      });
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (a.interleaved) {
      a.conjugate ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    } else {
      a.conjugate ? run(No{}, Yes{}) : run(No{}, No{});
    }
    return;
  }
#endif
  (void)stream;  // the portable loop stores plainly
  const C sign = a.conjugate ? C(-1) : C(1);
  const bool interleaved = a.interleaved;
  rotate_rows<T, C>(a, false, [=](const T* xr, T* orow, const C* c, const C* s) {
    rotate_row<T, C>(xr, orow, c, s, half, sign, interleaved);
  });
}

}  // namespace

static_assert(sizeof(Args) == 192, "Args must match the struct format in cpu_rope.py");

namespace {

// True when every position is a row of the table. The caller checks positions before the call, except where it
// cannot read them (inside torch.compile's graph, whose custom op then runs this kernel with positions nobody has
// looked at); one pass over n0 * n2 ids, before anything is written, keeps a bad one from reading past the table.
bool positions_in_table(const Args& a) {
  if (!a.pos) return true;
  bool ok = true;
  const uint64_t rows = static_cast<uint64_t>(a.rows);  // a negative position wraps past every table
  for (int64_t i0 = 0; i0 < a.n[0]; ++i0)
    for (int64_t i2 = 0; i2 < a.n[2]; ++i2) ok &= static_cast<uint64_t>(a.pos[i0 * a.ps[0] + i2 * a.ps[1]]) < rows;
  return ok;
}

// Streaming. A plain store into a line that is not in cache first reads the line (the write-allocate), so an
// out-of-place rotation of data larger than the cache moves each output byte twice: read and written back. A
// non-temporal store writes the line without reading it: with recycled buffers of q (1, 32, 8192, 128) bf16 this
// measured 0.74 -> 1.16 of a copy on a Zen 4 VM. It is a loss where the output is not in memory yet: glibc maps a
// big block anew, and each first write faults in a zeroed page that is then in cache (0.88 -> 0.83), and where the
// output fits in the cache that the caller reads next. So a call streams only what it writes out of place, when
// that totals more than the last-level cache, into pages that are already resident, or into huge pages (below).
// In bytes; cpu_rope.py sets it to the last-level cache's size when it loads the library.
std::atomic<int64_t> stream_threshold{int64_t(32) << 20};

bool resident(const void* p) {
#if defined(__linux__)
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char in_core = 0;
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  return mincore(start, 1, &in_core) == 0 && (in_core & 1);
#else
  (void)p;
  return false;
#endif
}

int64_t element_bytes(int32_t dtype) { return dtype == 0 ? 4 : dtype == 3 ? 8 : 2; }

// Job j of a packed call, copied out (the buffer needs no alignment).
Args job_args(const char* packed, int32_t job) {
  Args a;
  std::memcpy(&a, packed + job * sizeof(Args), sizeof(Args));
  return a;
}

// Huge pages. An output that the OS backs with transparent huge pages faults 2 MiB at a time, zeroed at once: more
// than stays in the core's cache until the kernel writes it, so streaming those stores skips reading the lines back
// (fresh output, s = 4096, Zen 5: bf16 0.76 -> 0.83 of a copy into huge pages, fp32 0.81 -> 0.89-0.92), where with
// 4 KiB pages it loses (below). The kernel asks for none (posenc.kernels.huge_pages advises the outputs it allocates,
// where that is safe); it looks: a call writes one byte at the start of the first whole huge page inside an output
// that it is about to write whole and that is not in memory yet, and that page's last 4 KiB are then in memory only
// if the fault brought a huge page (a 4 KiB fault brings in nothing around it for anonymous memory). Whoever gave
// the range huge pages (our advice, THP mode 'always', an allocator), they are found.
// The huge page size to look for, in bytes; 0: none (cpu_rope.py sets it when it loads the library).
std::atomic<int64_t> huge_page_bytes{0};
// What the last call streamed (posenc_last_streams).
std::atomic<uint64_t> last_streams{0};

// The bytes [first, end) of job a's output when the call writes all of them: out of place, every channel written
// (rotated or copied), and no gaps between the elements, whatever the order of the dims.
bool written_whole(const Args& a, int64_t size, uintptr_t& first, uintptr_t& end) {
  if (a.out == a.x || (!a.copy_tail && 2 * a.half != a.d)) return false;
  std::pair<int64_t, int64_t> dims[4] = {{1, a.d}};  // (stride, size), in elements
  int count = 1;
  for (int i = 0; i < 3; ++i) {
    if (a.n[i] == 0) return false;
    if (a.n[i] > 1) dims[count++] = {a.os[i], a.n[i]};
  }
  std::sort(dims, dims + count);
  int64_t elements = 1;
  for (int i = 0; i < count; ++i) {
    if (dims[i].second > 1 && dims[i].first != elements) return false;
    elements *= dims[i].second;
  }
  first = reinterpret_cast<uintptr_t>(a.out);
  end = first + static_cast<uintptr_t>(elements * size);
  return true;
}

// Whether job a's output, not in memory yet, is backed by huge pages (above). With `fault`, the call that is about
// to overwrite the output faults in its first whole huge page to find out; a query (posenc_stream_jobs) writes
// nothing, and says so only of a huge page already in memory.
bool in_huge_pages(const Args& a, int64_t size, bool fault) {
#if defined(__linux__)
  const auto page = static_cast<uintptr_t>(huge_page_bytes.load(std::memory_order_relaxed));
  uintptr_t start = 0, end = 0;
  if (page == 0 || !written_whole(a, size, start, end)) return false;
  const uintptr_t first = (start + page - 1) / page * page;
  if (first + page > end) return false;
  if (!resident(reinterpret_cast<const void*>(first))) {
    if (!fault) return false;
    *reinterpret_cast<volatile char*>(first) = 0;
  }
  return resident(reinterpret_cast<const void*>(first + page - static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))));
#else
  (void)a, (void)size, (void)fault;
  return false;
#endif
}

// Bit j set: job j streams its stores: the call writes more than the last-level cache out of place, into pages
// already in memory (recycled) or into huge pages (above). The page of an output's last element stands for all of
// it: the first pages of a fresh block are already touched by malloc's header. With `fault`, looking for huge pages
// faults one in (in_huge_pages).
uint64_t stream_jobs(const char* packed, int32_t count, int32_t dtype, bool fault) {
#if !defined(POSENC_AVX512) && !defined(POSENC_AVX2)
  (void)packed, (void)count, (void)dtype, (void)fault;
  return 0;  // the portable loop has no streaming stores
#else
  const int64_t size = element_bytes(dtype);
  int64_t bytes = 0;
  for (int32_t job = 0; job < count; ++job) {
    const Args a = job_args(packed, job);
    if (a.out != a.x) bytes += a.n[0] * a.n[1] * a.n[2] * a.d * size;
  }
  if (bytes == 0 || bytes < stream_threshold.load(std::memory_order_relaxed)) return 0;
  uint64_t mask = 0;
  for (int32_t job = 0; job < count && job < 64; ++job) {
    const Args a = job_args(packed, job);
    if (a.out == a.x || a.n[0] * a.n[1] * a.n[2] * a.d == 0) continue;
    const int64_t last = (a.n[0] - 1) * a.os[0] + (a.n[1] - 1) * a.os[1] + (a.n[2] - 1) * a.os[2] + a.d - 1;
    if (resident(static_cast<const char*>(a.out) + last * size) || in_huge_pages(a, size, fault))
      mask |= uint64_t(1) << job;
  }
  return mask;
#endif
}

}  // namespace

// Each job is one Args, packed by cpu_rope.py. dtype: 0 float32,
// 1 bfloat16, 2 float16, 3 float64; wide: cos/sin (and the math) in double. Returns 0; 1 for a combination that
// was not compiled; 2 when a position is outside the table (nothing is written then).
extern "C" int posenc_rope_jobs(const char* packed, int32_t count, int32_t dtype, int32_t wide) {
  last_streams.store(0, std::memory_order_relaxed);
  for (int32_t job = 0; job < count; ++job) {
    if (!positions_in_table(job_args(packed, job))) return 2;
  }
  const uint64_t streams = stream_jobs(packed, count, dtype, true);
  last_streams.store(streams, std::memory_order_relaxed);
  for (int32_t job = 0; job < count; ++job) {
    const Args a = job_args(packed, job);
    const bool stream = job < 64 && ((streams >> job) & 1);
    switch (dtype * 2 + wide) {
      case 0: rotate<float, float>(a, stream); break;
      case 1: rotate<float, double>(a, stream); break;
      case 2: rotate<bf16, float>(a, stream); break;
      case 3: rotate<bf16, double>(a, stream); break;
      case 4: rotate<f16, float>(a, stream); break;
      case 5: rotate<f16, double>(a, stream); break;
      case 7: rotate<double, double>(a, stream); break;
      default: return 1;
    }
  }
  return 0;
}

// Whether this build has streaming stores at all: the vector rows do, on Linux (residency comes from mincore).
extern "C" int posenc_can_stream() {
#if (defined(POSENC_AVX512) || defined(POSENC_AVX2)) && defined(__linux__)
  return 1;
#else
  return 0;
#endif
}

// Which of the packed jobs posenc_rope_jobs would stream (bit j for job j), for tests and benchmarks, writing
// nothing: an output whose pages are not in memory yet counts as in huge pages only once they are.
extern "C" uint64_t posenc_stream_jobs(const char* packed, int32_t count, int32_t dtype) {
  return stream_jobs(packed, count, dtype, false);
}

// Which jobs the last posenc_rope_jobs call in this process streamed (bit j for job j; 0 after a refused call),
// for tests.
extern "C" uint64_t posenc_last_streams() { return last_streams.load(std::memory_order_relaxed); }

// Sets the huge page size to look for under fresh outputs, 0 for none (above); returns the previous setting.
extern "C" int64_t posenc_set_huge_page_size(int64_t bytes) { return huge_page_bytes.exchange(bytes); }

// Sets the bytes a call must write out of place before it streams; returns the previous setting.
extern "C" int64_t posenc_set_stream_threshold(int64_t bytes) { return stream_threshold.exchange(bytes); }

extern "C" int posenc_rope(const char* packed, int32_t dtype, int32_t wide) {
  return posenc_rope_jobs(packed, 1, dtype, wide);
}
