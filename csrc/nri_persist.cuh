// Variant 4 of the fused insert (contract.md sections 3 and 4, the contract of
// csrc/norm_rope_insert.cu): persistent WARPS over (token, head chunk) items, the 16-byte
// lanes of variants 1 and 2 with their RoPE partners by warp shuffles, no shared memory and
// no block barrier. Instantiated by csrc/nri_persist_{bf16,f16}_d{64,128,256}.cu (variant 4)
// and csrc/nri_split_{bf16,f16}_d{64,128,256}.cu (variant 5), one translation unit per
// kernel, activation format and head dim; simulated on the CPU by csrc/nri_persist_host.cpp.
//
// Why: variant 1 (one short-lived block per (token, head block)) is issue-bound (0.8
// instructions per cycle per scheduler at the model shape) because every
// pass redid what does not change: the head's kind and weight (a load, a widening and 1 + w
// per element), the token's position, table row and cos / sin, the slots. Variant 3 moved
// the rows through shared memory and became latency-bound (18% occupancy). Here a warp
// keeps a lane's dims for the whole launch, so 1 + w_q stays in registers; it walks a
// CONTIGUOUS range of items, so a token's cos / sin are widened once per token and reused by
// its ceil(Hq / HPW) q items; and the q items (nearly all the bytes) take a path with no
// kind dispatch: load, normalise, rotate, round, store. (Variant 5's split loops walk
// STRIDED instead, items gw, gw + nw, ...: the warps in flight then read and write one
// window of consecutive items rather than nw ranges far apart, and the DRAM pages they open
// are shared, though cos / sin are now loaded per item.)
//
// Items: a token's heads are enumerated as everywhere (q, k, index_q, index_k); its q heads
// form nq = ceil(Hq / HPW) items, the others nr = ceil((Hkv + Hi + index_k) / HPW) items
// (HPW = G x ROUNDS heads per warp: G = 256 / D heads per 16-byte pass, ROUNDS passes), so
// no item mixes q with the rest. Item i is (token i / (nq + nr), chunk i % (nq + nr)).
// Warp gw of nw = gridDim.x x warps_per_block takes the items nri::persist_range(...) gives
// it (an even split, one item of difference at most). Per item the warp issues the x loads
// of its ROUNDS passes first (all lanes, zeros past the item's heads), then, on a new token,
// its position and cos / signed sin (16-byte loads when R/2 % 8 == 0), then computes.
//
// Arithmetic (explicitly rounded, as variants 1-3: BIT-IDENTICAL outputs): the lane's sum of
// squares in dim order (__fmaf_rn), the butterfly over the head's lanes, rs = rsqrtf(ss / D
// + eps), n = (x rs) (1 + w), partners by nri::exchange (shuffles), y = fma(n', s, n c) in the
// rotated dims, n beyond R. Stores: q items round and store y to q_out; the other items go
// through store_head (csrc/nri_vec.cuh, shared with variants 1-3: k and index_k in place, K/V
// and index_k into the caches at the token's slots, index_q to iq_out). A lane reads and
// writes only its own 16 bytes of each head (partners come by shuffle), so in-place writes
// need no ordering; every lane of a warp runs every shuffle (stores are what the guards skip).
#pragma once

#ifdef __CUDACC__
#include <mutex>
#endif

#include "nri_split.cuh"

namespace nri_dev {

// Blocks of kVecMaxWarps warps per SM asked of the register allocator: 80 registers for 2
// passes (3 blocks, 24 warps per SM); 4 passes, while they were instantiated, took 128 (the
// longer queue spilled at 80).
constexpr int persist_min_blocks(int rounds) { return rounds == 4 ? 2 : 3; }

// Variant 5's consecutive q items per strided step (q_items_split): 2, faster than 1 or 4.
constexpr int kQGroup = 2;

// Normalise and rotate one pass: the lane's 8 codes xb (dims c .. c + 7 of a head of D
// dims, LPH lanes), 1 + w of its dims w1, cos / signed sin cs / sn (0 in pass-through dims)
// -> y. Every lane of the warp must call it (shuffles). ALIGNED (R/2 % 8 == 0, the model's
// case): the lane's 8 dims share one RoPE role and one partner lane, `src` (nri::exchange's
// source lane for B = 0, computed once per lane by aligned_partner), and rotate when
// `rot_lane`; else nri::exchange and the role per dim. The same values either way.
template <int ACT, int D, bool ALIGNED>
__device__ __forceinline__ void norm_rope_pass(const uint32_t (&xb)[4], const float (&w1)[8],
                                               const float (&cs)[8], const float (&sn)[8],
                                               int l, int c, int hr, int src, bool rot_lane,
                                               float eps, float (&y)[8]) {
  constexpr int C = nri::kChunk;
  constexpr int LPH = nri::Geo<D>::kLanesPerHead;
  float x[C];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < C; ++j) {
    x[j] = widen<ACT>(xb, j);
    ss = __fmaf_rn(x[j], x[j], ss);
  }
#pragma unroll
  for (int o = LPH / 2; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, o));
  const float rs = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / D), eps));  // / D: exact, D = 2^k
  float n[C], np[C];
#pragma unroll
  for (int j = 0; j < C; ++j) n[j] = __fmul_rn(__fmul_rn(x[j], rs), w1[j]);
  if (ALIGNED) {
#pragma unroll
    for (int j = 0; j < C; ++j) np[j] = __shfl_sync(0xFFFFFFFFu, n[j], src, LPH);
#pragma unroll
    for (int j = 0; j < C; ++j)
      y[j] = rot_lane ? __fmaf_rn(np[j], sn[j], __fmul_rn(n[j], cs[j])) : n[j];
  } else {
    nri::exchange<LPH>(n, l, hr, WarpShfl<LPH>{}, np);
#pragma unroll
    for (int j = 0; j < C; ++j)
      y[j] = nri::rope_role(c + j, hr) == 2 ? n[j]
                                            : __fmaf_rn(np[j], sn[j], __fmul_rn(n[j], cs[j]));
  }
}

// 1 + w of the lane's dims c .. c + 7 (w: D codes of format ACT).
template <int ACT>
__device__ __forceinline__ void one_plus_w(const uint16_t* w, int c, float (&w1)[8]) {
  uint32_t wb[4];
  load8(w + c, wb);
#pragma unroll
  for (int j = 0; j < nri::kChunk; ++j) w1[j] = __fadd_rn(1.f, widen<ACT>(wb, j));
}

// Position pos's cos | sin row of the table; null outside the table (no row is read).
__device__ __forceinline__ const uint16_t* table_row(const NriParams& p, int64_t pos) {
  return pos >= 0 && pos < p.max_pos ? static_cast<const uint16_t*>(p.table) + pos * p.table_stride
                                     : nullptr;
}

// rope_codes (token tok's cos / signed sin at the lane's dims) widened to fp32.
template <int ACT>
__device__ __forceinline__ void rope_coeffs(const NriParams& p, int64_t tok, int c, int rot,
                                            float (&cs)[8], float (&sn)[8]) {
  uint32_t cw[4], sw[4];
  rope_codes(p, tok, c, rot, cw, sw);
#pragma unroll
  for (int j = 0; j < nri::kChunk; ++j) {
    cs[j] = widen<ACT>(cw, j);
    sn[j] = widen<ACT>(sw, j);
  }
}

// nri::exchange's source lane for the lane's 8 dims when R/2 % 8 == 0 (its B = 0 case: one
// partner lane for all 8, l + R/16 in the first half, l - R/16 in the second).
template <int LPH>
__device__ __forceinline__ int aligned_partner(int l, int c, int hr) {
  return (c < hr ? l + (hr >> 3) : l - (hr >> 3)) & (LPH - 1);
}

// The lane's geometry and the launch constants an item needs.
struct PersistLane {
  int grp, l, c, hr, src;
  bool rot_lane;
  float eps;
};

// A q item: the queued x codes of its passes (heads h0 + r G + grp, those below Hq stored)
// -> normalised, rotated, rounded, stored to q_out. Passes one after another (not unrolled:
// unrolled, the compiler interleaves the passes' shuffles and spills); the queue moves down.
template <int ACT, int D, int ROUNDS, bool ALIGNED>
__device__ __forceinline__ void q_item(const NriParams& p, const PersistLane& ln, int64_t tok,
                                       int h0, uint32_t (&xb)[ROUNDS][4],
                                       const float (&w1)[8], const float (&cs)[8],
                                       const float (&sn)[8]) {
  constexpr int G = nri::Geo<D>::kHeadsPerPass;
  const int hq = (int)p.hq;
  uint16_t* qo = static_cast<uint16_t*>(p.q_out) + tok * p.q_s0 + ln.c;
#pragma unroll 1
  for (int r = 0; r < ROUNDS; ++r) {
    const int t = h0 + r * G + ln.grp;
    float y[nri::kChunk];
    norm_rope_pass<ACT, D, ALIGNED>(xb[0], w1, cs, sn, ln.l, ln.c, ln.hr, ln.src, ln.rot_lane,
                                    ln.eps, y);
#pragma unroll
    for (int q = 0; q + 1 < ROUNDS; ++q) {
#pragma unroll
      for (int k = 0; k < 4; ++k) xb[q][k] = xb[q + 1][k];
    }
    if (t < hq) {
      uint32_t ob[4];
      pack8(y, ACT, ob);
      store8(qo + t * p.q_s1, ob);
    }
  }
}

// A q warp's share (warp gw of nw) of the q items (nq = ceil(Hq / HPW) per token, an even
// split, contiguous and token-major), each: the x loads of its passes,
// the token's cos / sin when the token changes, then q_item.
template <int ACT, int D, int ROUNDS, bool ALIGNED>
__device__ __forceinline__ void q_items(const NriParams& p, const PersistLane& ln, int64_t nw,
                                        int64_t gw) {
  constexpr int C = nri::kChunk;
  constexpr int G = nri::Geo<D>::kHeadsPerPass;
  constexpr int HPW = G * ROUNDS;
  const int hq = (int)p.hq;
  const int nq = (hq + HPW - 1) / HPW;
  int64_t it, end;
  nri::persist_range(p.n * nq, nw, gw, it, end);
  float wq1[C], cs[C], sn[C];  // 1 + w_q; cos / signed sin of token `cur`
  one_plus_w<ACT>(static_cast<const uint16_t*>(p.w_q), ln.c, wq1);
  int64_t tok = it / nq, cur = -1;
  int ch = (int)(it - tok * nq);
  for (; it < end; ++it) {
    const int h0 = ch * HPW;
    const uint16_t* x = static_cast<const uint16_t*>(p.rows) + tok * p.row_stride + ln.c;
    uint32_t xb[ROUNDS][4];
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
      const int t = h0 + r * G + ln.grp;
      if (t < hq) {
        load8(x + t * D, xb[r]);
      } else {
        xb[r][0] = xb[r][1] = xb[r][2] = xb[r][3] = 0;
      }
    }
    if (tok != cur) {
      cur = tok;
      rope_coeffs<ACT>(p, tok, ln.c, 2 * ln.hr, cs, sn);
    }
    q_item<ACT, D, ROUNDS, ALIGNED>(p, ln, tok, h0, xb, wq1, cs, sn);
    if (++ch == nq) {
      ch = 0;
      ++tok;
    }
  }
}

// --------------------------------------- variant 5: every head in split lanes (R = D / 2)
// Variant 5 is variant 4 with every head in the split lanes of csrc/nri_split.cuh when
// R = D / 2 (the model's): no partner shuffles (variant 4 spent 8 shuffles per 8 values on
// them), one butterfly per 16 values, every per-item cost over twice the values; its
// outputs may differ from variants 1-4 by an fp32 rounding (the sum of squares' order).
// Other R run variant 4's code (the same bits as 1-4).

// The x loads of an item's passes (its first head of the lane's group t0; heads past Hq
// zeros).
template <int D, int ROUNDS, bool AL>
__device__ __forceinline__ void split_item_loads(const NriParams& p, int64_t tok, int t0,
                                                 const SplitLane<D>& sl, SplitX (&xs)[ROUNDS]) {
  const uint16_t* x = static_cast<const uint16_t*>(p.rows) + tok * p.row_stride;
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const int t = t0 + r * SplitLane<D>::kHeads;
    if (t < (int)p.hq) {
      load_split<AL>(x + (int64_t)t * D, sl.ca, SplitLane<D>::kHalf, sl.cb, xs[r]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) xs[r].a[k] = xs[r].b[k] = 0;
    }
  }
}

// Variant 5's q items (R = D / 2): the items of q_items (token-major chunks of HPI heads,
// strided over the warps in groups of kQGroup), HPI = (32 / (D / 16)) x ROUNDS heads: per item
// every pass's x loads first, the token's cos / sin when the token changes, then the
// passes one after another. (Issuing the next item's loads before this item's arithmetic
// spills at 80 registers and is slower.)
template <int ACT, int D, int ROUNDS, bool AL>
__device__ __forceinline__ void q_items_split(const NriParams& p, int lane, float eps,
                                              int64_t nw, int64_t gw) {
  using SL = SplitLane<D>;
  constexpr int HPI = SL::kHeads * ROUNDS;
  const SL sl(lane);
  const int hq = (int)p.hq;
  const int nq = (hq + HPI - 1) / HPI;
  float wa[8], wb[8], c[4], s[4], sneg[4];
  split_weights<ACT, D>(static_cast<const uint16_t*>(p.w_q), sl, wa, wb);
  // Strided: warp gw takes the kQGroup consecutive items from gw x kQGroup, then those from
  // (gw + nw) x kQGroup, ...: the warps in flight read one window of consecutive items (DRAM
  // row locality), not nw distant ranges; a group's items of one token share its cos / sin.
  int64_t cur = -1;
  for (nri::StridedWalk w(gw * kQGroup, nw * kQGroup, nq); w.tok < p.n; w.next()) {
    int64_t tok = w.tok;
    int ch = w.sub;
#pragma unroll 1
    for (int g = 0; g < kQGroup && tok < p.n; ++g) {
      const int h0 = ch * HPI;
      SplitX xs[ROUNDS];
      split_item_loads<D, ROUNDS, AL>(p, tok, h0 + sl.grp, sl, xs);
      if (tok != cur) {
        cur = tok;
        split_rope<ACT, D, AL>(table_row(p, position_of(p, tok)), sl, c, s, sneg);
      }
      uint16_t* qo = static_cast<uint16_t*>(p.q_out) + tok * p.q_s0;
#pragma unroll 1
      for (int r = 0; r < ROUNDS; ++r) {
        const int t = h0 + r * SL::kHeads + sl.grp;
        float ya[8], yb[8];
        split_pass<ACT, D>(xs[0], wa, wb, c, s, sneg, eps, ya, yb);
#pragma unroll
        for (int q = 0; q + 1 < ROUNDS; ++q) xs[q] = xs[q + 1];
        if (t < hq) split_store16<D, AL>(qo + t * p.q_s1, sl, ya, yb, ACT);
      }
      if (++ch == nq) {
        ch = 0;
        ++tok;
      }
    }
  }
}

// Variant 5's other heads at R = D / 2, in the split lanes too: one loop per kind (KIND 1:
// k with V; 2: index_q; 3: index_k), so that its 1 + w stays in registers and its stores
// are fixed at compile time. Items: the kind's (token, head) pairs in token-major order,
// kHeads per item (one pass; at the model shape a token's 4 k or 4 index_q heads, or 4
// tokens' index_k), lane group g taking pair g. Per item: x (and V) in the split layout,
// the slot, the position, then the table row, one pass, the stores. (Variant 4's loop over
// all the other heads dispatched the kind per pass: 2,100-2,460 warp instructions per
// token, a third of the kernel's, issue-bound after the q stream.)
template <int ACT, int D, int KIND, bool AL>
__device__ __forceinline__ void split_kind_items(const NriParams& p, const SplitLane<D>& sl,
                                                 float eps, int64_t nw, int64_t gw) {
  using SL = SplitLane<D>;
  constexpr int HP = SL::kHeads;
  const int H = KIND == 1 ? (int)p.hkv : KIND == 2 ? (int)p.hi : 1;
  // the row column of the kind's head 0: q | k | v | index_q, index_k at ik_col
  const int64_t col0 = KIND == 1 ? p.hq * D : KIND == 2 ? (p.hq + 2 * p.hkv) * D : p.ik_col;
  float wa[8], wb[8], c[4], s[4], sneg[4];
  split_weights<ACT, D>(weight_of(p, KIND), sl, wa, wb);
  // Scalar K / V scales (every stride 0): their reciprocals once, not a dependent load and
  // two divisions per item.
  const bool scalar_sc = KIND == 1 && cvt::is_fp8((int)p.kv_fmt) && p.ks_s0 == 0 &&
                         p.ks_s1 == 0 && p.vs_s0 == 0 && p.vs_s1 == 0;
  cvt::ScaleReciprocal kr0{1.f, 1.f}, vr0{1.f, 1.f};
  if (scalar_sc) {
    kr0 = cvt::scale_reciprocal(p.k_scale[0]);
    vr0 = cvt::scale_reciprocal(p.v_scale[0]);
  }
  // Strided as the q items: item gw, gw + nw, ..., its first pair (w.tok, w.sub).
  for (nri::StridedWalk w(gw * HP, nw * HP, H); w.tok < p.n; w.next()) {
    const int64_t tok0 = w.tok;
    const int o = w.sub + sl.grp;
    const int64_t t = KIND == 3 ? tok0 + o : tok0 + o / H;
    const int h = KIND == 3 ? 0 : o % H;
    const bool ok = t < p.n;
    uint16_t* row = static_cast<uint16_t*>(p.rows) + (ok ? t : 0) * p.row_stride;
    SplitX x, v;
#pragma unroll
    for (int k = 0; k < 4; ++k) x.a[k] = x.b[k] = v.a[k] = v.b[k] = 0;
    int64_t slot = -1, pos = -1;
    if (ok) {
      load_split<AL>(row + col0 + h * D, sl.ca, SL::kHalf, sl.cb, x);
      if (KIND == 1) {
        load_split<AL>(row + (p.hq + p.hkv + h) * D, sl.ca, SL::kHalf, sl.cb, v);
        slot = load_index(p.slots, p.slots_is64, t * p.slot_stride);
      } else if (KIND == 3) {
        slot = load_index(p.islots, p.islots_is64, t * p.islot_stride);
      }
      pos = position_of(p, t);
    }
    split_rope<ACT, D, AL>(table_row(p, pos), sl, c, s, sneg);
    float ya[8], yb[8];
    split_pass<ACT, D>(x, wa, wb, c, s, sneg, eps, ya, yb);
    if (ok) {
      if (KIND == 2) {
        const int64_t off = t * p.iq_s0 + h * p.iq_s1;
        if (cvt::is_fp8((int)p.iq_fmt))
          split_store_fp8<D>(static_cast<uint8_t*>(p.iq_out) + off, sl, ya, yb, (int)p.iq_fmt);
        else
          split_store16<D, AL>(static_cast<uint16_t*>(p.iq_out) + off, sl, ya, yb, ACT);
      } else {
        split_store16<D, AL>(row + col0 + h * D, sl, ya, yb, ACT);  // k, index_k in place
      }
      if (KIND == 1 && slot >= 0 && slot < p.num_slots) {
        const int64_t base = nri::page_offset(slot, p.page_size, p.kv_s0, p.kv_s2) + h * p.kv_s1;
        const int fmt = (int)p.kv_fmt;
        if (cvt::is_fp8(fmt)) {
          cvt::ScaleReciprocal kr = kr0, vr = vr0;
          if (!scalar_sc) {
            const KvScales sc = kv_scales(p, HeadRef{1, h, 0}, slot, base);
            kr = cvt::scale_reciprocal(sc.k);
            vr = cvt::scale_reciprocal(sc.v);
          }
          float ka[8], kb[8], va[8], vb[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            ka[j] = ya[j] * kr.a * kr.b, kb[j] = yb[j] * kr.a * kr.b;
            va[j] = widen<ACT>(v.a, j) * vr.a * vr.b, vb[j] = widen<ACT>(v.b, j) * vr.a * vr.b;
          }
          uint8_t* dst = static_cast<uint8_t*>(p.kv) + base;
          split_store_fp8<D>(dst, sl, ka, kb, fmt);
          split_store_fp8<D>(dst + D, sl, va, vb, fmt);
        } else {
          uint16_t* dst = static_cast<uint16_t*>(p.kv) + base;
          split_store16<D, AL>(dst, sl, ya, yb, fmt);
          if (fmt == ACT) {
            split_copy16<D, AL>(dst + D, sl, v);  // a bit copy
          } else {
            float va[8], vb[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) va[j] = widen<ACT>(v.a, j), vb[j] = widen<ACT>(v.b, j);
            split_store16<D, AL>(dst + D, sl, va, vb, fmt);
          }
        }
      }
      if (KIND == 3 && slot >= 0 && slot < p.ic_num_slots) {
        const int64_t base = nri::page_offset(slot, p.ic_page, p.ic_s0, p.ic_s1);
        if (cvt::is_fp8((int)p.ic_fmt))
          split_store_fp8<D>(static_cast<uint8_t*>(p.ic) + base, sl, ya, yb, (int)p.ic_fmt);
        else
          split_store16<D, AL>(static_cast<uint16_t*>(p.ic) + base, sl, ya, yb, ACT);
      }
    }
  }
}

// The kinds one after another; their extra items (the first items % nw warps take one
// more) on alternating ends of the warps.
template <int ACT, int D, bool AL>
__device__ __forceinline__ void split_other_items(const NriParams& p, int lane, float eps,
                                                  int64_t nw, int64_t gw) {
  const SplitLane<D> sl(lane);
  split_kind_items<ACT, D, 1, AL>(p, sl, eps, nw, nw - 1 - gw);
  if (p.hi > 0) split_kind_items<ACT, D, 2, AL>(p, sl, eps, nw, gw);
  if (p.write_ik) split_kind_items<ACT, D, 3, AL>(p, sl, eps, nw, nw - 1 - gw);
}

// Whether every 16-bit access of the split loops is aligned (8 bytes for 4 codes, 16 for 8):
// the rows and their columns, q_out, the table, and the 16-bit outputs among index_q and
// the caches, bases and strides. Then the loops compile without the element-wise
// fallbacks, whose predicated instructions are issued on every access (about 50 of a q
// item's 127 instructions).
__device__ __forceinline__ bool split_aligned(const NriParams& p) {
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  bool ok = a16(p.rows) && p.row_stride % 8 == 0 && p.ik_col % 8 == 0 && a16(p.q_out) &&
            p.q_s0 % 8 == 0 && p.q_s1 % 8 == 0 && a16(p.table) && p.table_stride % 8 == 0;
  if (p.hi > 0 && !cvt::is_fp8((int)p.iq_fmt))
    ok = ok && a16(p.iq_out) && p.iq_s0 % 8 == 0 && p.iq_s1 % 8 == 0;
  if (!cvt::is_fp8((int)p.kv_fmt))
    ok = ok && a16(p.kv) && p.kv_s0 % 8 == 0 && p.kv_s1 % 8 == 0 && p.kv_s2 % 8 == 0;
  if (p.write_ik && !cvt::is_fp8((int)p.ic_fmt))
    ok = ok && a16(p.ic) && p.ic_s0 % 8 == 0 && p.ic_s1 % 8 == 0;
  return ok;
}

// The warp's share (warp gw of nw, taken in reverse order: the warps given one q item more
// than others are not also given one of these more) of the items of the other heads (k
// with V, index_q, index_k: nr = ceil((Hkv + Hi + index_k) / HPW) per token). Per item: the
// token's slots, the x and V loads of all its passes and their K/V scales issued together
// (one latency per item, not one per pass: these items are few and run after the q items,
// where nothing else hides their latency), then pass after pass through store_head (not
// unrolled: its code once; the queues move down).
template <int ACT, int D, int ROUNDS>
__device__ __forceinline__ void rest_items(const NriParams& p, const PersistLane& ln,
                                           int64_t nw, int64_t gw) {
  constexpr int C = nri::kChunk;
  constexpr int G = nri::Geo<D>::kHeadsPerPass;
  constexpr int HPW = G * ROUNDS;
  const int hq = (int)p.hq;
  const int total = (int)(p.hq + p.hkv + p.hi + p.write_ik);
  const int nr = (total - hq + HPW - 1) / HPW;
  int64_t it, end;
  nri::persist_range(p.n * nr, nw, nw - 1 - gw, it, end);
  float cs[C], sn[C];
  int64_t tok = it / nr, cur = -1;  // nr >= 1: Hkv >= 1
  int ch = (int)(it - tok * nr);
  for (; it < end; ++it) {
    const int h0 = hq + ch * HPW;
    const int h_end = min(total, h0 + HPW);
    uint16_t* row = static_cast<uint16_t*>(p.rows) + tok * p.row_stride;
    // Cache offsets of the token's slots (-1: not written): page * s0 + offset * s2.
    int64_t slot = -1, kv_base = -1, ic_base = -1;
    if (h0 < hq + p.hkv) {
      slot = load_index(p.slots, p.slots_is64, tok * p.slot_stride);
      if (slot >= 0 && slot < p.num_slots)
        kv_base = (slot / p.page_size) * p.kv_s0 + (slot % p.page_size) * p.kv_s2;
    }
    if (p.write_ik && h_end == total) {
      const int64_t islot = load_index(p.islots, p.islots_is64, tok * p.islot_stride);
      if (islot >= 0 && islot < p.ic_num_slots)
        ic_base = (islot / p.ic_page) * p.ic_s0 + (islot % p.ic_page) * p.ic_s1;
    }
    uint32_t xb[ROUNDS][4], vb[ROUNDS][4];
    KvScales sc[ROUNDS];
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
      const HeadRef hd = head_ref<D>(p, h0 + r * G + ln.grp, h_end);
#pragma unroll
      for (int k = 0; k < 4; ++k) xb[r][k] = vb[r][k] = 0;
      if (hd.kind >= 0) load8(row + hd.col + ln.c, xb[r]);
      if (hd.kind == 1) load8(row + (p.hq + p.hkv + hd.h) * D + ln.c, vb[r]);
      sc[r] = kv_scales(p, hd, slot, kv_base);
    }
    if (tok != cur) {
      cur = tok;
      rope_coeffs<ACT>(p, tok, ln.c, 2 * ln.hr, cs, sn);
    }
    const int passes = (h_end - h0 + G - 1) / G;  // uniform over the warp
#pragma unroll 1
    for (int r = 0; r < passes; ++r) {
      const HeadRef hd = head_ref<D>(p, h0 + r * G + ln.grp, h_end);
      float w1[C], y[C];
      one_plus_w<ACT>(weight_of(p, hd.kind), ln.c, w1);
      if ((ln.hr & 7) == 0) {  // uniform over the launch
        norm_rope_pass<ACT, D, true>(xb[0], w1, cs, sn, ln.l, ln.c, ln.hr, ln.src, ln.rot_lane,
                                     ln.eps, y);
      } else {
        norm_rope_pass<ACT, D, false>(xb[0], w1, cs, sn, ln.l, ln.c, ln.hr, 0, false, ln.eps,
                                      y);
      }
      if (hd.kind >= 0)
        store_head<ACT, D>(p, hd, tok, row, ln.c, y, vb[0], sc[0], kv_base, ic_base);
#pragma unroll
      for (int q = 0; q + 1 < ROUNDS; ++q) {
#pragma unroll
        for (int k = 0; k < 4; ++k) xb[q][k] = xb[q + 1][k], vb[q][k] = vb[q + 1][k];
        sc[q] = sc[q + 1];
      }
    }
    if (++ch == nr) {
      ch = 0;
      ++tok;
    }
  }
}

// Every warp takes its q items, then its items of the other heads: two loops one after the
// other, each with its own registers (one loop running both kinds spilled; giving some
// warps only the other heads, which are latency-bound, makes them the last to finish).
// Prefetching the q items' x through a lane-private cp.async ring in shared memory does not
// pay (docs/tuning.md).
// SPLIT: variant 5's split loops (the host launches it only when persist_split); else
// variant 4's loops. Two kernels, so that each compiles in its own translation unit.
template <int ACT, int D, int ROUNDS, bool SPLIT>
__global__ void __launch_bounds__(kVecMaxWarps * 32, persist_min_blocks(ROUNDS))
nri_persist_kernel(const NriParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t wpb = blockDim.x >> 5;
  const int64_t nw = (int64_t)gridDim.x * wpb;
  const int64_t gw = (int64_t)blockIdx.x * wpb + (threadIdx.x >> 5);
  if constexpr (SPLIT) {
    const float eps = (float)p.eps;
    if (split_aligned(p)) {
      q_items_split<ACT, D, ROUNDS, true>(p, lane, eps, nw, gw);
      split_other_items<ACT, D, true>(p, lane, eps, nw, gw);
    } else {
      q_items_split<ACT, D, ROUNDS, false>(p, lane, eps, nw, gw);
      split_other_items<ACT, D, false>(p, lane, eps, nw, gw);
    }
  } else {
    constexpr int C = nri::kChunk;
    constexpr int LPH = nri::Geo<D>::kLanesPerHead;
    PersistLane ln;
    ln.grp = lane / LPH;
    ln.l = lane % LPH;
    ln.c = ln.l * C;
    ln.hr = (int)(p.rotary_dim >> 1);
    ln.src = aligned_partner<LPH>(ln.l, ln.c, ln.hr);
    ln.rot_lane = ln.c < p.rotary_dim;
    ln.eps = (float)p.eps;
    if ((ln.hr & 7) == 0) {
      q_items<ACT, D, ROUNDS, true>(p, ln, nw, gw);
    } else {
      q_items<ACT, D, ROUNDS, false>(p, ln, nw, gw);
    }
    rest_items<ACT, D, ROUNDS>(p, ln, nw, gw);
  }
}

#ifdef __CUDACC__
// The persistent grid's size for an instantiation: SMs x resident blocks of `threads`
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor), cached per instantiation for the last
// (device, threads), so that a launch inside a CUDA graph capture only reads the cache.
template <int ACT, int D, int ROUNDS, bool SPLIT>
cudaError_t persist_grid_cap(int threads, int64_t* cap) {
  static std::mutex mu;
  static int c_dev = -1, c_threads = 0;
  static int64_t c_cap = 0;
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (dev == c_dev && threads == c_threads) {
    *cap = c_cap;
    return cudaSuccess;
  }
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, nri_persist_kernel<ACT, D, ROUNDS, SPLIT>, threads, 0);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  c_dev = dev, c_threads = threads, c_cap = (int64_t)sms * per_sm;
  *cap = c_cap;
  return cudaSuccess;
}

// Launches the kernel of variant 4 (SPLIT false) or 5: nri::persist_grid blocks of
// p.warps_per_block warps, kPersistRounds passes per item (the only instantiation).
template <int ACT, int D, bool SPLIT>
cudaError_t launch_persist(const NriParams& p, int rounds, cudaStream_t s) {
  constexpr int R = kPersistRounds;
  if (rounds != R) return cudaErrorInvalidValue;
  const int threads = (int)p.warps_per_block * 32;
  int64_t cap = 0;
  const cudaError_t e = persist_grid_cap<ACT, D, R, SPLIT>(threads, &cap);
  if (e != cudaSuccess) return e;
  const int64_t items = p.n * nri::persist_items_per_token(p.hq, p.hkv + p.hi + p.write_ik,
                                                           nri::Geo<D>::kHeadsPerPass * R);
  const unsigned grid = (unsigned)nri::persist_grid(cap, items, p.warps_per_block);
  nri_persist_kernel<ACT, D, R, SPLIT><<<grid, threads, 0, s>>>(p);
  return cudaGetLastError();
}
#endif  // __CUDACC__ (csrc/nri_persist_host.cpp runs the kernel on the CPU instead)

}  // namespace nri_dev
