// fp8 / bf16 / fp16 conversions of contract.md section 1, as __host__ __device__ inline
// functions: the CPU tests (tests/test_csrc.py) compile this header with g++ and check every
// function exhaustively against reference/codec.py; the kernels use the same code on the GPU.
//
// Formats (the codes are reference/formats.py's kernel_code; 4 and 5 are the 16-bit cache dtypes):
//   FMT_E4M3FN 0   OCP, bias 7,  max 448   (0x7E), no Inf, NaN 0x7F/0xFF, -0 = 0x80
//   FMT_E5M2   1   OCP, bias 15, max 57344 (0x7B), Inf 0x7C/0xFC, NaN 0x7D-0x7F/0xFD-0xFF
//   FMT_E4M3FNUZ 2 bias 8,  max 240   (0x7F), no Inf, no -0, NaN 0x80 only
//   FMT_E5M2FNUZ 3 bias 16, max 57344 (0x7F), no Inf, no -0, NaN 0x80 only
//   FMT_BF16 4, FMT_F16 5
//
// Encoding (fp32 -> code): round to nearest even onto the format's grid, subnormals
// included, then the overflow policy:
//   satfinite      finite overflow and +-Inf -> +-max finite; NaN -> the canonical NaN
//                  (0x7F OCP, 0x80 fnuz). What cvt.rn.satfinite and vLLM's KV writes do.
//   nonsaturating  (OCP "overflow" mode, ml_dtypes astype) overflow and +-Inf -> NaN 0x7F
//                  (e4m3fn), +-Inf (e5m2, bf16, fp16), 0x80 (fnuz).
// Rounding comes first: 464 -> 448 in e4m3fn, 61440 -> Inf (nonsaturating) in e5m2.
// -0 encodes to 0x80 in the OCP formats and to 0x00 in fnuz (as does any negative value
// that rounds to zero). bf16/fp16 NaN encodes to 0x7FC0 / 0x7E00 (reference.codec's codes).
// Decoding is exact; NaN codes give a quiet NaN, e5m2/bf16/fp16 Inf codes give +-Inf.
//
// On the device (__CUDA_ARCH__), satfinite encoding to the OCP formats uses the native
// conversion cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (sm_89+; the instruction cuda_fp8.h's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) emits), which writes 0x7F for every NaN; the
// 16-bit roundings and the fp16 widening use cvt.rn.bf16.f32 / cvt.rn.f16.f32 / cvt.f32.f16
// (what __float2bfloat16_rn / __float2half_rn / __half2float emit). The instructions are
// written as inline PTX so that no CUDA header is needed: cuda_fp8.h and friends double
// nvcc's front-end time. Everything else, and everything on the host, is the integer
// software path below, which never forms an fp32 subnormal intermediate except when
// decoding a bf16 subnormal (exact on host and device: nvcc's default is -ftz=false).
#pragma once

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define CVT_HD __host__ __device__ __forceinline__
#else
#define CVT_HD inline
#endif

namespace cvt {

enum Format : int {
  FMT_E4M3FN = 0,
  FMT_E5M2 = 1,
  FMT_E4M3FNUZ = 2,
  FMT_E5M2FNUZ = 3,
  FMT_BF16 = 4,
  FMT_F16 = 5,
};

// Conventions of the special values (reference.codec.FloatFormat.specials).
enum Specials : int { SP_FN = 0, SP_IEEE = 1, SP_FNUZ = 2 };

CVT_HD bool is_fp8(int fmt) { return fmt >= FMT_E4M3FN && fmt <= FMT_E5M2FNUZ; }

CVT_HD uint32_t f32_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
#endif
}

CVT_HD float bits_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// fp32 -> code of a binary format with M mantissa bits, exponent bias BIAS, sign bit at
// BITS-1, largest finite positive code MAXC, canonical NaN code NANC; RNE, subnormals,
// either overflow policy. Integer arithmetic on the fp32 bits only.
template <int M, int BIAS, int BITS, uint32_t MAXC, uint32_t NANC, int SPECIALS>
CVT_HD uint32_t encode_bits(float x, bool satfinite) {
  const uint32_t bits = f32_bits(x);
  const uint32_t sign = bits >> 31;
  const uint32_t a = bits & 0x7FFFFFFFu;  // |x|; > 0x7F800000 is NaN
  if (a > 0x7F800000u) return NANC;
  const int e32 = (int)(a >> 23);
  uint32_t mag;
  if (e32 >= 128 - BIAS) {
    // Normal range of the target: round the 23-bit mantissa to M bits, ties to even (a
    // carry ripples into the exponent field, as it must), then rebias. Inf lands far above
    // MAXC. No overflow of the uint32: a <= 0x7F800000.
    const uint32_t lsb = (a >> (23 - M)) & 1u;
    const uint32_t rounded = (a + ((1u << (22 - M)) - 1u) + lsb) >> (23 - M);
    mag = rounded - ((uint32_t)(127 - BIAS) << M);
  } else {
    // Subnormal range (|x| < 2^(1-BIAS)): the code is |x| in units of the smallest
    // subnormal 2^(1-BIAS-M): the 24-bit significand shifted right, ties to even. fp32
    // subnormal inputs (e32 = 0) have no implicit bit and the exponent of e32 = 1.
    // shift >= 24 - M >= 13; beyond 31 everything rounds to 0 (sig < 2^24 <= half).
    const uint32_t sig = e32 ? ((a & 0x7FFFFFu) | 0x800000u) : a;
    const int e_eff = e32 ? e32 : 1;
    int shift = 151 - BIAS - M - e_eff;
    if (shift > 31) shift = 31;
    const uint32_t q = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    const bool up = rem > half || (rem == half && (q & 1u));
    mag = q + (up ? 1u : 0u);  // the largest subnormal rounds up to the smallest normal
  }
  const uint32_t sbit = sign << (BITS - 1);
  if (mag > MAXC) {  // finite overflow after rounding, or Inf
    if (satfinite) return MAXC | sbit;
    if (SPECIALS == SP_IEEE) return (MAXC + 1u) | sbit;  // the Inf code
    return NANC;
  }
  if (SPECIALS == SP_FNUZ && mag == 0) return 0;  // no -0
  return mag | sbit;
}

// code -> exact fp32 value of an 8- or 16-bit format (as encode_bits; SUB = the smallest
// subnormal 2^(1-BIAS-M), a power of two, so m * SUB is exact).
template <int M, int BIAS, int BITS, int SPECIALS>
CVT_HD float decode_bits(uint32_t c, float sub) {
  const uint32_t sign = ((c >> (BITS - 1)) & 1u) << 31;
  const uint32_t mag = c & ((1u << (BITS - 1)) - 1u);
  const uint32_t e = mag >> M;
  const uint32_t m = mag & ((1u << M) - 1u);
  const uint32_t top = (1u << (BITS - 1 - M)) - 1u;  // all-ones exponent
  if (SPECIALS == SP_FNUZ && c == (1u << (BITS - 1))) return bits_f32(0x7FC00000u);
  if (SPECIALS == SP_FN && mag == (1u << (BITS - 1)) - 1u) return bits_f32(0x7FC00000u);
  if (SPECIALS == SP_IEEE && e == top)
    return bits_f32(m ? 0x7FC00000u : (0x7F800000u | sign));
  if (e == 0) {
    const float v = (float)m * sub;
    return sign ? -v : v;
  }
  return bits_f32(((mag << (23 - M)) + ((uint32_t)(127 - BIAS) << 23)) | sign);
}

// ------------------------------------------------------------------------------ fp8

CVT_HD uint8_t fp8_encode_sw(float x, int fmt, bool satfinite) {
  switch (fmt) {
    case FMT_E4M3FN:
      return (uint8_t)encode_bits<3, 7, 8, 0x7Eu, 0x7Fu, SP_FN>(x, satfinite);
    case FMT_E5M2:
      return (uint8_t)encode_bits<2, 15, 8, 0x7Bu, 0x7Fu, SP_IEEE>(x, satfinite);
    case FMT_E4M3FNUZ:
      return (uint8_t)encode_bits<3, 8, 8, 0x7Fu, 0x80u, SP_FNUZ>(x, satfinite);
    default:
      return (uint8_t)encode_bits<2, 16, 8, 0x7Fu, 0x80u, SP_FNUZ>(x, satfinite);
  }
}

// Satfinite encode for the kernels: native cvt.rn.satfinite for the OCP formats on sm_89+,
// the software path elsewhere.
template <int FMT>
CVT_HD uint8_t fp8_encode_satfinite(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (FMT == FMT_E4M3FN || FMT == FMT_E5M2) {
    // A NaN of either sign and any payload gives 0x7F, the canonical code
    // (test_device_codec_equals_reference checks it on every GPU that runs the tests).
    uint16_t pair;  // low byte: x, high byte: 0
    if (FMT == FMT_E4M3FN)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(x), "f"(0.f));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(x), "f"(0.f));
    return (uint8_t)(pair & 0xFFu);
  }
#endif
  return fp8_encode_sw(x, FMT, true);
}

// Runtime-format versions (a switch; uniform across a launch).
CVT_HD uint8_t fp8_encode_satfinite(float x, int fmt) {
  switch (fmt) {
    case FMT_E4M3FN: return fp8_encode_satfinite<FMT_E4M3FN>(x);
    case FMT_E5M2: return fp8_encode_satfinite<FMT_E5M2>(x);
    case FMT_E4M3FNUZ: return fp8_encode_satfinite<FMT_E4M3FNUZ>(x);
    default: return fp8_encode_satfinite<FMT_E5M2FNUZ>(x);
  }
}

CVT_HD uint8_t fp8_encode(float x, int fmt, bool satfinite) {
  return satfinite ? fp8_encode_satfinite(x, fmt) : fp8_encode_sw(x, fmt, false);
}

// The division by a KV scale as two multiplications: x * a * b is x / s within one fp32
// ulp (the oracle allows Fp32Arith.div_ulp = 2.5) for every fp32 s, where a correctly
// rounded division costs ~10 instructions per value. b is a power of two (1 unless s lies
// outside [2^-100, 2^100]) keeping a = RN(1 / (s b)) normal, so (x a) b rounds once more
// only far outside every fp8 range; s = +-0, +-Inf, NaN give what x / s gives. The same
// rule as kernels/fp8.py's scale_reciprocal.
struct ScaleReciprocal {
  float a, b;
};

CVT_HD ScaleReciprocal scale_reciprocal(float s) {
  const float b = s < 0x1p-100f ? 0x1p64f : (s > 0x1p100f ? 0x1p-64f : 1.0f);
  return ScaleReciprocal{1.0f / (s * b), b};
}

CVT_HD float fp8_decode(uint8_t c, int fmt) {
  switch (fmt) {
    case FMT_E4M3FN: return decode_bits<3, 7, 8, SP_FN>(c, 0.001953125f);            // 2^-9
    case FMT_E5M2: return decode_bits<2, 15, 8, SP_IEEE>(c, 1.52587890625e-05f);     // 2^-16
    case FMT_E4M3FNUZ: return decode_bits<3, 8, 8, SP_FNUZ>(c, 0.0009765625f);      // 2^-10
    default: return decode_bits<2, 16, 8, SP_FNUZ>(c, 7.62939453125e-06f);         // 2^-17
  }
}

// ---------------------------------------------------------------------- bf16 / fp16

// fp32 -> bf16 bits, RNE, overflow -> +-Inf, NaN -> 0x7FC0 (software path).
CVT_HD uint16_t bf16_from_f32_sw(float x) {
  return (uint16_t)encode_bits<7, 127, 16, 0x7F7Fu, 0x7FC0u, SP_IEEE>(x, false);
}

// fp32 -> fp16 bits, RNE with subnormals, overflow -> +-Inf, NaN -> 0x7E00 (software path).
CVT_HD uint16_t f16_from_f32_sw(float x) {
  return (uint16_t)encode_bits<10, 15, 16, 0x7BFFu, 0x7E00u, SP_IEEE>(x, false);
}

CVT_HD uint16_t bf16_from_f32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (x != x) return 0x7FC0;
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return b;
#else
  return bf16_from_f32_sw(x);
#endif
}

CVT_HD uint16_t f16_from_f32(float x) {
#ifdef __CUDA_ARCH__
  if (x != x) return 0x7E00;
  uint16_t b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return b;
#else
  return f16_from_f32_sw(x);
#endif
}

CVT_HD float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

CVT_HD float f16_to_f32(uint16_t b) {
#ifdef __CUDA_ARCH__
  float x;
  asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(b));
  return x;
#else
  return decode_bits<10, 15, 16, SP_IEEE>(b, 5.9604644775390625e-08f);  // 2^-24
#endif
}

// 16-bit model dtype (FMT_BF16 / FMT_F16) <-> fp32.
CVT_HD uint16_t half_from_f32(float x, int fmt) {
  return fmt == FMT_BF16 ? bf16_from_f32(x) : f16_from_f32(x);
}

CVT_HD float half_to_f32(uint16_t b, int fmt) {
  return fmt == FMT_BF16 ? bf16_to_f32(b) : f16_to_f32(b);
}

}  // namespace cvt
