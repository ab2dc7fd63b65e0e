// Device helpers shared by the fused insert's translation units (csrc/norm_rope_insert.cu:
// variant 0 and the launcher; csrc/nri_vec_*.cu: variants 1 and 2, kernel in
// csrc/nri_vec.cuh; csrc/nri_stream_*.cu: variant 3, kernel in csrc/nri_stream.cuh), and
// the entry points of variants 1-3.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "fp8_convert.h"
#include "norm_rope_insert.h"

namespace nri_dev {

// Variants 1 and 2 take 1, 2, 4 or 8 warps per block (the kernels' launch bound).
constexpr int kVecMaxWarps = 8;

template <int B>
struct Word;
template <>
struct Word<2> { using T = uint16_t; };
template <>
struct Word<4> { using T = uint32_t; };
template <>
struct Word<8> { using T = uint2; };
template <>
struct Word<16> { using T = uint4; };

// N elements of type E at p: one vector access when p is aligned to the whole span, else
// element by element (rows, outputs and caches may have any alignment their strides give).
template <int N, typename E>
__device__ __forceinline__ void load_n(const E* p, E (&out)[N]) {
  constexpr int B = N * sizeof(E);
  if (reinterpret_cast<uintptr_t>(p) % B == 0) {
    typename Word<B>::T w = *reinterpret_cast<const typename Word<B>::T*>(p);
    memcpy(out, &w, B);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = p[j];
  }
}

template <int N, typename E>
__device__ __forceinline__ void store_n(E* p, const E (&v)[N]) {
  constexpr int B = N * sizeof(E);
  if (reinterpret_cast<uintptr_t>(p) % B == 0) {
    typename Word<B>::T w;
    memcpy(&w, v, B);
    *reinterpret_cast<typename Word<B>::T*>(p) = w;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = v[j];
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

template <int N>
__device__ __forceinline__ void encode_n(const float (&y)[N], int fmt, uint8_t (&c)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) c[j] = cvt::fp8_encode_satfinite(y[j], fmt);
}

template <int ACT, int N>
__device__ __forceinline__ void round_n(const float (&y)[N], uint16_t (&b)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) b[j] = cvt::half_from_f32(y[j], ACT);
}

// ------------------------------------------- 8 16-bit codes packed in 4 registers
// Element j lives in bits 16 (j & 1) .. 16 (j & 1) + 15 of w[j >> 1] (the little-endian
// memory order, so a 16-byte access moves the 4 words as they are).

// AL: the caller knows p is aligned (the unaligned path compiles away; otherwise both
// paths' instructions are issued, predicated).
template <bool AL = false>
__device__ __forceinline__ void load8(const uint16_t* p, uint32_t (&w)[4]) {
  if (AL || reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = (uint32_t)p[2 * k] | ((uint32_t)p[2 * k + 1] << 16);
  }
}

// The aligned case is one 128-bit store: written as a uint4 assignment, ptxas (CUDA 13.0,
// sm_90) split it into four 32-bit STG when the packed words did not sit in 4 consecutive
// registers (a quarter of the stores' issue slots and L2 requests otherwise).
template <bool AL = false>
__device__ __forceinline__ void store8(uint16_t* p, const uint32_t (&w)[4]) {
  if (AL || reinterpret_cast<uintptr_t>(p) % 16 == 0) {
#ifdef __CUDA_ARCH__
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
#else
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
#endif
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      p[2 * k] = (uint16_t)(w[k] & 0xFFFFu);
      p[2 * k + 1] = (uint16_t)(w[k] >> 16);
    }
  }
}

// 4 16-bit codes at p into w[k0], w[k0 + 1] (an 8-byte access when aligned).
template <bool AL = false>
__device__ __forceinline__ void load4(const uint16_t* p, uint32_t (&w)[4], int k0) {
  if (AL || reinterpret_cast<uintptr_t>(p) % 8 == 0) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[k0] = v.x, w[k0 + 1] = v.y;
  } else {
    w[k0] = (uint32_t)p[0] | ((uint32_t)p[1] << 16);
    w[k0 + 1] = (uint32_t)p[2] | ((uint32_t)p[3] << 16);
  }
}

// w[k0], w[k0 + 1] (4 16-bit codes) to p.
template <bool AL = false>
__device__ __forceinline__ void store4(uint16_t* p, const uint32_t (&w)[4], int k0) {
  if (AL || reinterpret_cast<uintptr_t>(p) % 8 == 0) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[k0], w[k0 + 1]);
  } else {
    p[0] = (uint16_t)(w[k0] & 0xFFFFu), p[1] = (uint16_t)(w[k0] >> 16);
    p[2] = (uint16_t)(w[k0 + 1] & 0xFFFFu), p[3] = (uint16_t)(w[k0 + 1] >> 16);
  }
}

// 4 bytes (one word, byte j in bits 8 j) to p.
__device__ __forceinline__ void store4b(uint8_t* p, uint32_t w) {
  if (reinterpret_cast<uintptr_t>(p) % 4 == 0) {
    *reinterpret_cast<uint32_t*>(p) = w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = (uint8_t)(w >> (8 * j));
  }
}

// 8 bytes packed in 2 words (byte j in bits 8 (j & 3) of w[j >> 2]).
__device__ __forceinline__ void store8b(uint8_t* p, const uint32_t (&w)[2]) {
  if (reinterpret_cast<uintptr_t>(p) % 8 == 0) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = (uint8_t)(w[j >> 2] >> (8 * (j & 3)));
  }
}

__device__ __forceinline__ uint16_t code16(const uint32_t (&w)[4], int j) {
  return (uint16_t)(w[j >> 1] >> (16 * (j & 1)));
}

// Element j widened to fp32 (exact): cvt::half_to_f32 of code16(w, j).
template <int ACT>
__device__ __forceinline__ float widen(const uint32_t (&w)[4], int j) {
  if (ACT == cvt::FMT_BF16)
    return __uint_as_float((j & 1) ? (w[j >> 1] & 0xFFFF0000u) : (w[j >> 1] << 16));
  return cvt::half_to_f32(code16(w, j), ACT);
}

// Two fp32 -> two 16-bit codes of format FMT (bf16 / fp16, RNE), element 0 in the low half:
// cvt::half_from_f32 of each. On the device one paired cvt (cvt.rn.{bf16x2,f16x2}.f32) and
// one unordered compare, the per-element conversion only when a NaN is present (the paired
// cvt writes 0x7FFF for NaN; the project's canonical NaN codes are cvt::half_from_f32's).
__device__ __forceinline__ uint32_t pack2(float lo, float hi, int fmt) {
#ifdef __CUDA_ARCH__
  uint32_t nan;  // lo or hi is a NaN: one unordered compare
  asm("{ .reg .pred q; setp.nan.f32 q, %1, %2; selp.u32 %0, 1, 0, q; }"
      : "=r"(nan)
      : "f"(lo), "f"(hi));
  if (!nan) {
    uint32_t w;
    if (fmt == cvt::FMT_BF16)
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    else
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
  }
#endif
  return (uint32_t)cvt::half_from_f32(lo, fmt) | ((uint32_t)cvt::half_from_f32(hi, fmt) << 16);
}

// fp32 -> 16-bit codes of format FMT (bf16 / fp16, RNE: cvt::half_from_f32), packed. On the
// device one unordered-compare chain over the 8 values and, without a NaN, four paired cvts
// (one branch per 8 values instead of one per pair).
__device__ __forceinline__ void pack8(const float (&y)[8], int fmt, uint32_t (&w)[4]) {
#ifdef __CUDA_ARCH__
  uint32_t nan;
  asm("{ .reg .pred q; setp.nan.f32 q, %1, %2; setp.nan.or.f32 q, %3, %4, q;"
      " setp.nan.or.f32 q, %5, %6, q; setp.nan.or.f32 q, %7, %8, q; selp.u32 %0, 1, 0, q; }"
      : "=r"(nan)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  if (!nan) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (fmt == cvt::FMT_BF16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(y[2 * k + 1]), "f"(y[2 * k]));
      else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(y[2 * k + 1]), "f"(y[2 * k]));
    }
    return;
  }
#endif
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = pack2(y[2 * k], y[2 * k + 1], fmt);
}

// fp32 -> fp8 codes of format FMT (satfinite: cvt::fp8_encode_satfinite<FMT>), packed. On
// sm_89+ the OCP formats convert two values per cvt.rn.satfinite.{e4m3,e5m2}x2.f32, which
// writes the canonical NaN code 0x7F for every NaN (as cvt::fp8_encode_satfinite relies on;
// a check per pair and the software path for NaN pairs would slow the insert down).
template <int FMT>
__device__ __forceinline__ void encode8_t(const float (&y)[8], uint32_t (&w)[2]) {
  w[0] = w[1] = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr bool kPaired = FMT == cvt::FMT_E4M3FN || FMT == cvt::FMT_E5M2;
#else
  constexpr bool kPaired = false;
#endif
  if constexpr (kPaired) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float lo = y[2 * k], hi = y[2 * k + 1];
      uint16_t h;
      if (FMT == cvt::FMT_E4M3FN)
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(hi), "f"(lo));
      else
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(h) : "f"(hi), "f"(lo));
      w[k >> 1] |= (uint32_t)h << (16 * (k & 1));
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      w[j >> 2] |= (uint32_t)cvt::fp8_encode_satfinite<FMT>(y[j]) << (8 * (j & 3));
  }
}

// The same for a runtime format (uniform over a launch): the dispatch is once per 8 values,
// so that each format's conversion is a branch of its own (a switch per value let the
// compiler evaluate all four formats' encoders for every value).
__device__ __forceinline__ void encode8(const float (&y)[8], int fmt, uint32_t (&w)[2]) {
  switch (fmt) {
    case cvt::FMT_E4M3FN: encode8_t<cvt::FMT_E4M3FN>(y, w); break;
    case cvt::FMT_E5M2: encode8_t<cvt::FMT_E5M2>(y, w); break;
    case cvt::FMT_E4M3FNUZ: encode8_t<cvt::FMT_E4M3FNUZ>(y, w); break;
    default: encode8_t<cvt::FMT_E5M2FNUZ>(y, w); break;
  }
}

}  // namespace nri_dev

// Variants 1 (XCHG_SHFL) and 2 (XCHG_GLOBAL) of csrc/nri_vec.cuh, one translation unit per
// variant and activation format (csrc/nri_vec_{shfl,global}_{bf16,f16}.cu) so that they
// compile in parallel: launch `grid` x `block` of the vectorised kernel with `rounds`
// passes per warp (1, 2 or 4); return cudaGetLastError().
#define NRI_VEC_ENTRY(name)                                                                 \
  cudaError_t name(const NriParams& p, int rounds, dim3 grid, dim3 block, cudaStream_t s)
NRI_VEC_ENTRY(nri_launch_vec_shfl_bf16);
NRI_VEC_ENTRY(nri_launch_vec_shfl_f16);
NRI_VEC_ENTRY(nri_launch_vec_global_bf16);
NRI_VEC_ENTRY(nri_launch_vec_global_f16);

// Variant 3 (csrc/nri_stream.cuh), one translation unit per activation format
// (csrc/nri_stream_{bf16,f16}.cu): the persistent grid with `rounds` head rounds per warp
// and pass (kStreamRounds = 2 only) and p.stages stages (2 .. 8, explicit); return the first
// failing CUDA call's error (cudaErrorInvalidValue when the shared memory exceeds the
// device's, or for another `rounds`).
#define NRI_STREAM_ENTRY(name) cudaError_t name(const NriParams& p, int rounds, cudaStream_t s)
NRI_STREAM_ENTRY(nri_launch_stream_bf16_d64);
NRI_STREAM_ENTRY(nri_launch_stream_bf16_d128);
NRI_STREAM_ENTRY(nri_launch_stream_bf16_d256);
NRI_STREAM_ENTRY(nri_launch_stream_f16_d64);
NRI_STREAM_ENTRY(nri_launch_stream_f16_d128);
NRI_STREAM_ENTRY(nri_launch_stream_f16_d256);

// Variants 4 and 5 (csrc/nri_persist.cuh): persistent warps with kPersistRounds passes per
// item and p.warps_per_block warps per block; return the first failing CUDA call's error
// (cudaErrorInvalidValue for another `rounds`). Two kernels, one translation unit each per
// activation format and head dim, so that they compile in parallel: variant 4's loops
// (csrc/nri_persist_{bf16,f16}_d{64,128,256}.cu, also variant 5's fallback) and variant 5's
// split loops (csrc/nri_split_{bf16,f16}_d{64,128,256}.cu, when persist_split). One kernel
// holding both would be the cold build's slowest unit by far.
namespace nri_dev {
constexpr int kPersistDefaultWarps = 8;  // warps per block
// 16-byte passes per item: 2 only, the fastest at every block width.
constexpr int kPersistRounds = 2;
}  // namespace nri_dev
// Whether a variant-4/5 launch runs variant 5's split loops (its lane split needs R = D / 2;
// other rotary dims take variant 4's loops, bit-identical).
inline __host__ __device__ bool persist_split(const NriParams& p) {
  return p.variant == 5 && 4 * (p.rotary_dim >> 1) == p.head_dim;
}
#define NRI_PERSIST_ENTRY(name) cudaError_t name(const NriParams& p, int rounds, cudaStream_t s)
NRI_PERSIST_ENTRY(nri_launch_persist_bf16_d64);
NRI_PERSIST_ENTRY(nri_launch_persist_bf16_d128);
NRI_PERSIST_ENTRY(nri_launch_persist_bf16_d256);
NRI_PERSIST_ENTRY(nri_launch_persist_f16_d64);
NRI_PERSIST_ENTRY(nri_launch_persist_f16_d128);
NRI_PERSIST_ENTRY(nri_launch_persist_f16_d256);
NRI_PERSIST_ENTRY(nri_launch_split_bf16_d64);
NRI_PERSIST_ENTRY(nri_launch_split_bf16_d128);
NRI_PERSIST_ENTRY(nri_launch_split_bf16_d256);
NRI_PERSIST_ENTRY(nri_launch_split_f16_d64);
NRI_PERSIST_ENTRY(nri_launch_split_f16_d128);
NRI_PERSIST_ENTRY(nri_launch_split_f16_d256);
