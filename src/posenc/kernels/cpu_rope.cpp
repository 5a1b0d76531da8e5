// Fused rotary embedding for CPU tensors: one pass over x, math in float (or double), OpenMP over rows.
//
// Built by cpu_rope.py with the system C++ compiler and called through ctypes; it includes no torch header, so
// it builds in about a second. Rows are the three leading dims of a (n0, n1, n2, d) strided view; the row of
// cos/sin used by row (i0, i1, i2) is c0*i0 + c1*i1 + c2*p with p = pos[i0*ps0 + i2*ps2] (table mode) or i2.
#include <cstdint>
#include <cstring>
#include <type_traits>

// The fp16 path uses the AVX-512 conversion instructions where the build CPU has them (-march=native); the
// portable integer conversions below stay for every other CPU.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define POSENC_AVX512_F16 1
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
  // 2^112 * 2^-110 scaling, and NaN maps to the canonical half NaN.
  const uint32_t w = float_to_bits(v);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float base = bits_to_float((bias >> 1) + 0x07800000u) + (__builtin_fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return f16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}
template <>
inline f16 store<f16, double>(double v) { return store<f16, float>(static_cast<float>(v)); }

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
};

#ifdef POSENC_AVX512_F16
// 16 fp16 lanes <-> float with vcvtph2ps / vcvtps2ph: exact IEEE conversions (subnormals included, round to
// nearest even), so they match torch bit for bit; gcc does not emit them from the portable code above, and the
// integer rounding there costs several instructions per element (measured: fp16 forward 0.65 -> 0.80 of a copy).
// bf16 keeps the portable code: vcvtneps2bf16 (which also flushes subnormals, unlike torch) measured no faster.
struct F16Lanes {
  static __m512 to_float(__m256i v) { return _mm512_cvtph_ps(v); }
  static __m256i from_float(__m512 f) { return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

inline void rotate_row_f16(const uint16_t* xr, uint16_t* orow, const float* c, const float* s, int64_t half,
                           float sign, bool interleaved) {
  // 16 pairs per step; the last partial step is masked, so every size takes this path.
  const __m512 sg = _mm512_set1_ps(sign);
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (half - i)) - 1);
    const __m512 ci = _mm512_maskz_loadu_ps(m, c + i);
    const __m512 si = _mm512_mul_ps(sg, _mm512_maskz_loadu_ps(m, s + i));
    __m256i a, b;
    if (interleaved) {
      // One 32-bit word holds a pair: its low half is x1, its high half x2.
      const __m512i w = _mm512_maskz_loadu_epi32(m, xr + 2 * i);
      a = _mm512_cvtepi32_epi16(w);
      b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16));
    } else {
      a = _mm256_maskz_loadu_epi16(m, xr + i);
      b = _mm256_maskz_loadu_epi16(m, xr + i + half);
    }
    const __m512 x1 = F16Lanes::to_float(a), x2 = F16Lanes::to_float(b);
    const __m256i o1 = F16Lanes::from_float(_mm512_fmsub_ps(x1, ci, _mm512_mul_ps(x2, si)));
    const __m256i o2 = F16Lanes::from_float(_mm512_fmadd_ps(x2, ci, _mm512_mul_ps(x1, si)));
    if (interleaved) {
      const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(o1), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o2), 16));
      _mm512_mask_storeu_epi32(orow + 2 * i, m, w);
    } else {
      _mm256_mask_storeu_epi16(orow + i, m, o1);
      _mm256_mask_storeu_epi16(orow + i + half, m, o2);
    }
  }
}
#endif

template <typename T, typename C>
inline void rotate_row(const T* xr, T* orow, const C* c, const C* s, int64_t half, int64_t tail, C sign,
                       bool interleaved, bool copy_tail) {
#ifdef POSENC_AVX512_F16
  if constexpr (std::is_same_v<T, f16> && std::is_same_v<C, float>) {
    rotate_row_f16(reinterpret_cast<const uint16_t*>(xr), reinterpret_cast<uint16_t*>(orow), c, s, half, sign,
                   interleaved);
    if (copy_tail && tail > 0) std::memcpy(orow + 2 * half, xr + 2 * half, tail * sizeof(T));
    return;
  }
#endif
  // In place, orow == xr: each pair is read before it is written and pairs are disjoint, so the vectorizer may
  // ignore the apparent aliasing.
  if (interleaved) {
#pragma GCC ivdep
    for (int64_t i = 0; i < half; ++i) {
      const C x1 = load(xr[2 * i]), x2 = load(xr[2 * i + 1]), ci = c[i], si = sign * s[i];
      orow[2 * i] = store<T, C>(x1 * ci - x2 * si);
      orow[2 * i + 1] = store<T, C>(x2 * ci + x1 * si);
    }
  } else {
#pragma GCC ivdep
    for (int64_t i = 0; i < half; ++i) {
      const C x1 = load(xr[i]), x2 = load(xr[i + half]), ci = c[i], si = sign * s[i];
      orow[i] = store<T, C>(x1 * ci - x2 * si);
      orow[i + half] = store<T, C>(x2 * ci + x1 * si);
    }
  }
  if (copy_tail && tail > 0) std::memcpy(orow + 2 * half, xr + 2 * half, tail * sizeof(T));
}

template <typename T, typename C>
void rotate(const Args& a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const C* cos_ = static_cast<const C*>(a.cos);
  const C* sin_ = static_cast<const C*>(a.sin);
  const int64_t n0 = a.n[0], n1 = a.n[1], n2 = a.n[2];
  const C sign = a.conjugate ? C(-1) : C(1);
  // Work items are (i0, block of BLOCK positions along dim 2, i1): the cos/sin rows of one block stay in cache
  // while every head (dim 1) uses them, instead of being streamed once per head.
  constexpr int64_t BLOCK = 32;
  const int64_t blocks = (n2 + BLOCK - 1) / BLOCK;
  const int64_t items = n0 * blocks * n1;
#pragma omp parallel for num_threads(a.threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t i1 = item % n1, blk = (item / n1) % blocks, i0 = item / (n1 * blocks);
    const int64_t end = (blk + 1) * BLOCK < n2 ? (blk + 1) * BLOCK : n2;
    for (int64_t i2 = blk * BLOCK; i2 < end; ++i2) {
      const int64_t p = a.pos ? a.pos[i0 * a.ps[0] + i2 * a.ps[1]] : i2;
      const int64_t co = i0 * a.cs[0] + i1 * a.cs[1] + p * a.cs[2];
      rotate_row<T, C>(x + i0 * a.xs[0] + i1 * a.xs[1] + i2 * a.xs[2], out + i0 * a.os[0] + i1 * a.os[1] + i2 * a.os[2],
                       cos_ + co, sin_ + co, a.half, a.d - 2 * a.half, sign, a.interleaved, a.copy_tail);
    }
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16, 3 float64; wide: cos/sin (and the math) in double. Returns 0, or 1
// for a combination that was not compiled.
extern "C" int posenc_rope(const Args* a, int32_t dtype, int32_t wide) {
  switch (dtype * 2 + wide) {
    case 0: rotate<float, float>(*a); return 0;
    case 1: rotate<float, double>(*a); return 0;
    case 2: rotate<bf16, float>(*a); return 0;
    case 3: rotate<bf16, double>(*a); return 0;
    case 4: rotate<f16, float>(*a); return 0;
    case 5: rotate<f16, double>(*a); return 0;
    case 7: rotate<double, double>(*a); return 0;
    default: return 1;
  }
}
