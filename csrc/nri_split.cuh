// The split lanes of variant 5 (R = D / 2): D / 16 lanes per head, lane j of a
// head holding the rotated pairs' dims 4j .. 4j + 3 and R/2 + 4j .. R/2 + 4j + 3 (two
// 8-byte accesses, group A of its 16 values) and the pass-through dims R + 8j .. R + 8j + 7
// (one 16-byte access, group B), as the Triton kernel's segments lay them out. A lane then
// holds both halves of its RoPE pairs: no partner exchange, one butterfly of log2(D / 16)
// steps per 16 values. The arithmetic per value is variant 4's (explicit roundings,
// y = fma(n', +-s, n c), n = (x rs) (1 + w)); only the sum of squares runs in another order
// (the lane's 16 values, then the butterfly), so rs, and so q, may differ from variants
// 1-4 by an fp32 rounding. Used by csrc/nri_persist.cuh (variant 5).
#pragma once

#include "nri_vec.cuh"

namespace nri_dev {

// A lane's place in the split layout of a head of D dims.
template <int D>
struct SplitLane {
  static constexpr int kLanes = D / 16;       // lanes per head
  static constexpr int kHeads = 32 / kLanes;  // heads per warp pass
  static constexpr int kHalf = D / 4;         // R / 2
  int grp, ca, cb;                            // head of the pass; group A and B offsets
  __device__ __forceinline__ explicit SplitLane(int lane)
      : grp(lane / kLanes), ca(4 * (lane % kLanes)), cb(2 * kHalf + 8 * (lane % kLanes)) {}
};

// A head's 16 values of the lane (group A: pairs, group B: pass-through), as loaded.
struct SplitX {
  uint32_t a[4], b[4];
};

template <bool AL = false>
__device__ __forceinline__ void load_split(const uint16_t* head, int ca, int half, int cb,
                                           SplitX& x) {
  load4<AL>(head + ca, x.a, 0);
  load4<AL>(head + half + ca, x.a, 2);
  load8<AL>(head + cb, x.b);
}

// One pass of variant 5: x -> y (group A: the rotated pairs, y1 then y2; group B: n), for
// 1 + w wa / wb, cos c and sin s at the lane's pair dims (both 0 outside the table, s +0
// then, as rope_codes). Every lane of the warp must call it (the butterfly).
template <int ACT, int D>
__device__ __forceinline__ void split_pass(const SplitX& x, const float (&wa)[8],
                                           const float (&wb)[8], const float (&c)[4],
                                           const float (&s)[4], const float (&sneg)[4],
                                           float eps, float (&ya)[8], float (&yb)[8]) {
  constexpr int LH = D / 16;
  float xa[8], xb[8];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xa[j] = widen<ACT>(x.a, j);
    ss = __fmaf_rn(xa[j], xa[j], ss);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xb[j] = widen<ACT>(x.b, j);
    ss = __fmaf_rn(xb[j], xb[j], ss);
  }
#pragma unroll
  for (int o = LH / 2; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, o));
  const float rs = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / D), eps));  // / D: exact, D = 2^k
  float n[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) n[j] = __fmul_rn(__fmul_rn(xa[j], rs), wa[j]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    ya[k] = __fmaf_rn(n[4 + k], sneg[k], __fmul_rn(n[k], c[k]));
    ya[4 + k] = __fmaf_rn(n[k], s[k], __fmul_rn(n[4 + k], c[k]));
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) yb[j] = __fmul_rn(__fmul_rn(xb[j], rs), wb[j]);
}


// 1 + w of the lane's 16 dims (w: D codes of format ACT).
template <int ACT, int D>
__device__ __forceinline__ void split_weights(const uint16_t* w, const SplitLane<D>& sl,
                                              float (&wa)[8], float (&wb)[8]) {
  SplitX x;
  load_split(w, sl.ca, SplitLane<D>::kHalf, sl.cb, x);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    wa[j] = __fadd_rn(1.f, widen<ACT>(x.a, j));
    wb[j] = __fadd_rn(1.f, widen<ACT>(x.b, j));
  }
}

// cos c, sin s and signed sin sneg at the lane's pair dims from a table row (cos | sin, R
// codes; null: a position outside the table, all 0, sneg +0, as rope_codes).
template <int ACT, int D, bool AL = false>
__device__ __forceinline__ void split_rope(const uint16_t* trow, const SplitLane<D>& sl,
                                           float (&c)[4], float (&s)[4], float (&sneg)[4]) {
  uint32_t cw[4] = {0, 0, 0, 0};
  if (trow != nullptr) {
    load4<AL>(trow + sl.ca, cw, 0);
    load4<AL>(trow + SplitLane<D>::kHalf + sl.ca, cw, 2);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    c[k] = widen<ACT>(cw, k);
    s[k] = widen<ACT>(cw, 4 + k);
    sneg[k] = trow != nullptr ? -s[k] : 0.f;
  }
}

// A head's codes (SplitX's layout) to o (the head's D codes).
template <int D, bool AL = false>
__device__ __forceinline__ void split_copy16(uint16_t* o, const SplitLane<D>& sl,
                                             const SplitX& x) {
  store4<AL>(o + sl.ca, x.a, 0);
  store4<AL>(o + SplitLane<D>::kHalf + sl.ca, x.a, 2);
  store8<AL>(o + sl.cb, x.b);
}

// Rounds a head's y (group A, group B) to 16-bit format fmt and stores it to o.
template <int D, bool AL = false>
__device__ __forceinline__ void split_store16(uint16_t* o, const SplitLane<D>& sl,
                                              const float (&ya)[8], const float (&yb)[8],
                                              int fmt) {
  SplitX x;
  pack8(ya, fmt, x.a);
  pack8(yb, fmt, x.b);
  split_copy16<D, AL>(o, sl, x);
}

// A head's y as fp8 codes of format fmt (satfinite) to o (the head's D bytes).
template <int D>
__device__ __forceinline__ void split_store_fp8(uint8_t* o, const SplitLane<D>& sl,
                                                const float (&ya)[8], const float (&yb)[8],
                                                int fmt) {
  uint32_t a[2], b[2];
  encode8(ya, fmt, a);
  encode8(yb, fmt, b);
  store4b(o + sl.ca, a[0]);
  store4b(o + SplitLane<D>::kHalf + sl.ca, a[1]);
  store8b(o + sl.cb, b);
}

}  // namespace nri_dev
