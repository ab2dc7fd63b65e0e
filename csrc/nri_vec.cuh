// Variants 1 and 2 of the fused insert (contract.md sections 3 and 4, the contract of
// csrc/norm_rope_insert.cu): 16-byte lanes, several heads in flight per warp. Instantiated
// by csrc/nri_vec_{shfl,global}_{bf16,f16}.cu (variant 1 / 2, bf16 / fp16 activations), one
// translation unit each so that they compile in parallel.
//
// Layout (csrc/nri_lanes.h): lane l of a head's group holds dims c = 8 l .. c + 7 of one
// head (one 16-byte load / store); a warp holds G = 256 / D heads per instruction and makes
// ROUNDS such passes, HPW = G * ROUNDS heads per warp, whose x loads (and, for XCHG_GLOBAL,
// partner-x loads) are all issued before the first reduction, then the token's position,
// table row and slots are read (their latency overlaps the x loads'). A block of wpb warps
// owns heads_per_block = wpb * HPW consecutive heads of one token (no loop: a loop's
// carried state cost registers, i.e. loads in flight). Each lane reads the cos and sin of
// its 8 dims once, straight from the table row (16-byte loads when R/2 % 8 == 0; no shared
// memory, no block barrier).
//
// RoPE partners: XCHG_SHFL shuffles the fp32 normalised values inside the head's lane group
// (nri::exchange: 8 shuffles per lane and pass when R/2 % 8 is 0 or 4, 16 otherwise);
// XCHG_GLOBAL re-reads the partner dims' x and weight from global memory (16-byte loads when
// R/2 % 8 == 0, element by element otherwise; L1/L2 hits) and normalises them with the
// head's scale: the same fp32 value the partner lane computes. With XCHG_SHFL a lane reads
// and writes only its own 8 dims of the row (no ordering needed); XCHG_GLOBAL reads other
// lanes' dims, so a __syncwarp after the loads orders them before any in-place store.
//
// Arithmetic as variant 0: n = (x * r) * (1 + w), r = rsqrtf(sum(x^2) / D + eps), the sum
// per lane in dim order (fma) then a butterfly over the group's lanes (every lane of a
// group ends with the same bits: IEEE + is commutative); y = fma(n', -s, n c) for the first
// half (the sign flipped in the sine's code: exact), fma(n', s, n c) for the second, y = n
// beyond R; every operation explicitly rounded, so all instantiations (passes, exchange)
// give the same bits. Outputs, caches, guards, strides and 64-bit offsets as variant 0.
#pragma once

#include "nri_device.cuh"
#include "nri_lanes.h"

namespace nri_dev {

enum Xchg : int { XCHG_SHFL = 1, XCHG_GLOBAL = 2 };

// Blocks of kVecMaxWarps warps per SM asked of the register allocator
// (__launch_bounds__(256, min_blocks): at most 65536 / (256 min_blocks) registers, rounded
// down to 8): the tightest cap at which ptxas (CUDA 13.0, sm_90) spills nothing for the
// queue of ROUNDS passes: 64 registers (32 warps per SM, the most that 1-warp blocks can
// hold anyway) for 1 and 2 passes with shuffles (D = 256 with 2: 80, fp16 spilled at 64),
// 80 or 128 for the longer queues.
constexpr int vec_min_blocks(int d, int rounds, int xchg) {
  return rounds == 1   ? 4
         : rounds == 2 ? (xchg == XCHG_SHFL && d < 256 ? 4 : 3)
                       : (xchg == XCHG_SHFL ? 3 : 2);
}

template <int LPH>
struct WarpShfl {
  __device__ __forceinline__ float operator()(const float (&n)[nri::kChunk], int k,
                                              int src) const {
    return __shfl_sync(0xFFFFFFFFu, n[k], src, LPH);
  }
};

// Head t of the token: kind 0 q, 1 k, 2 index_q, 3 index_k (-1: none, t >= h_end, the
// block's end), its index within the kind and its first column in the row. 32-bit:
// nri_launch bounds the head count and the row width.
struct HeadRef {
  int kind, h, col;
};

template <int D>
__device__ __forceinline__ HeadRef head_ref(const NriParams& p, int t, int h_end) {
  const int hq = (int)p.hq, hkv = (int)p.hkv, hi = (int)p.hi;
  if (t >= h_end) return HeadRef{-1, 0, 0};
  if (t < hq) return HeadRef{0, t, t * D};
  if (t < hq + hkv) return HeadRef{1, t - hq, t * D};
  if (t < hq + hkv + hi) return HeadRef{2, t - hq - hkv, (t + hkv) * D};
  return HeadRef{3, 0, (int)p.ik_col};
}

__device__ __forceinline__ const uint16_t* weight_of(const NriParams& p, int kind) {
  const void* w = kind == 1 ? p.w_k : kind == 2 ? p.w_iq : kind == 3 ? p.w_ik : p.w_q;
  return static_cast<const uint16_t*>(w);
}

// The 8 codes at the partner dims of the lane's dims c .. c + 7 of the vector at v
// (zeros for pass-through dims): one 16-byte load when R/2 % 8 == 0.
__device__ __forceinline__ void load_partner8(const uint16_t* v, int c, int rot, int hr,
                                              uint32_t (&w)[4]) {
  if (c >= rot) {
    w[0] = w[1] = w[2] = w[3] = 0;
  } else if ((hr & 7) == 0) {
    load8(v + nri::partner_chunk(c, hr), w);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int d0 = c + 2 * k, d1 = d0 + 1;
      const uint32_t lo = d0 < rot ? v[nri::partner_dim(d0, hr)] : 0u;
      const uint32_t hi = d1 < rot ? v[nri::partner_dim(d1, hr)] : 0u;
      w[k] = lo | (hi << 16);
    }
  }
}

// The loads of one pass (head t of the lane's group): x and, for XCHG_GLOBAL, the partner
// x; zeros past the block's end.
template <int D, int XCHG>
__device__ __forceinline__ void load_pass(const NriParams& p, const uint16_t* row, int t,
                                          int h_end, int c, int rot, int hr, uint32_t (&xb)[4],
                                          uint32_t (&xpb)[4]) {
  const HeadRef hd = head_ref<D>(p, t, h_end);
  if (hd.kind < 0) {
    xb[0] = xb[1] = xb[2] = xb[3] = 0;
    xpb[0] = xpb[1] = xpb[2] = xpb[3] = 0;
    return;
  }
  load8(row + hd.col + c, xb);
  if (XCHG == XCHG_GLOBAL) load_partner8(row + hd.col, c, rot, hr, xpb);
}

// K and V scales of head hd at the token's slot for store_head: loaded for a k head written
// into an fp8 cache (kv_base >= 0), 1 otherwise (unused). Apart from store_head so that a
// caller can issue the loads early (variant 4 does, with the head's other loads).
struct KvScales {
  float k, v;
};

__device__ __forceinline__ KvScales kv_scales(const NriParams& p, const HeadRef& hd,
                                              int64_t slot, int64_t kv_base) {
  if (hd.kind != 1 || kv_base < 0 || !cvt::is_fp8((int)p.kv_fmt)) return KvScales{1.f, 1.f};
  const int64_t h = hd.h;
  return KvScales{p.k_scale[h * p.ks_s0 + slot * p.ks_s1],
                  p.v_scale[h * p.vs_s0 + slot * p.vs_s1]};
}

// The outputs of head hd (kind >= 0) from its fp32 values y (the lane's dims c .. c + 7):
// q -> q_out, index_q -> iq_out (model dtype or fp8 codes), k and index_k in place in the
// token's row (global memory) and into the caches at kv_base / ic_base (the token's slot
// offsets page * s0 + offset * s2 / s1; -1: not written), V from its model-dtype codes vb
// (k heads only), its scales sc (kv_scales). Shared by variants 1, 2 (this file), 3
// (csrc/nri_stream.cuh) and 4 (csrc/nri_persist.cuh), so that they write the same bits.
template <int ACT, int D>
__device__ __forceinline__ void store_head(const NriParams& p, const HeadRef& hd, int64_t tok,
                                           uint16_t* row, int c, const float (&y)[nri::kChunk],
                                           const uint32_t (&vb)[4], KvScales sc,
                                           int64_t kv_base, int64_t ic_base) {
  constexpr int C = nri::kChunk;
  const int kind = hd.kind;
  const int64_t h = hd.h;
  if (kind == 0) {
    uint32_t ob[4];
    pack8(y, ACT, ob);
    store8(static_cast<uint16_t*>(p.q_out) + tok * p.q_s0 + h * p.q_s1 + c, ob);
  } else if (kind == 2) {
    const int64_t off = tok * p.iq_s0 + h * p.iq_s1 + c;
    if (cvt::is_fp8((int)p.iq_fmt)) {
      uint32_t qc[2];
      encode8(y, (int)p.iq_fmt, qc);
      store8b(static_cast<uint8_t*>(p.iq_out) + off, qc);
    } else {
      uint32_t ob[4];
      pack8(y, ACT, ob);
      store8(static_cast<uint16_t*>(p.iq_out) + off, ob);
    }
  } else if (kind == 1) {
    uint32_t ob[4];
    pack8(y, ACT, ob);
    store8(row + hd.col + c, ob);
    if (kv_base >= 0) {
      const int64_t base = kv_base + h * p.kv_s1 + c;
      const int fmt = (int)p.kv_fmt;
      if (cvt::is_fp8(fmt)) {
        const cvt::ScaleReciprocal kr = cvt::scale_reciprocal(sc.k);
        const cvt::ScaleReciprocal vr = cvt::scale_reciprocal(sc.v);
        float kq[C], vq[C];
#pragma unroll
        for (int j = 0; j < C; ++j) {
          kq[j] = y[j] * kr.a * kr.b;
          vq[j] = widen<ACT>(vb, j) * vr.a * vr.b;
        }
        uint32_t kc[2], vc[2];
        encode8(kq, fmt, kc);
        encode8(vq, fmt, vc);
        uint8_t* dst = static_cast<uint8_t*>(p.kv) + base;
        store8b(dst, kc);
        store8b(dst + D, vc);
      } else {
        uint32_t kc[4], vc[4];
        pack8(y, fmt, kc);
        if (fmt == ACT) {
#pragma unroll
          for (int k = 0; k < 4; ++k) vc[k] = vb[k];  // a bit copy
        } else {
          float v[C];
#pragma unroll
          for (int j = 0; j < C; ++j) v[j] = widen<ACT>(vb, j);
          pack8(v, fmt, vc);
        }
        uint16_t* dst = static_cast<uint16_t*>(p.kv) + base;
        store8(dst, kc);
        store8(dst + D, vc);
      }
    }
  } else if (kind == 3) {
    uint32_t ob[4];
    pack8(y, ACT, ob);
    store8(row + hd.col + c, ob);
    if (ic_base >= 0) {
      const int64_t base = ic_base + c;
      if (cvt::is_fp8((int)p.ic_fmt)) {
        uint32_t qc[2];
        encode8(y, (int)p.ic_fmt, qc);
        store8b(static_cast<uint8_t*>(p.ic) + base, qc);
      } else {
        store8(static_cast<uint16_t*>(p.ic) + base, ob);
      }
    }
  }
}

// The position of token tok.
__device__ __forceinline__ int64_t position_of(const NriParams& p, int64_t tok) {
  return load_index(p.positions, p.pos_is64, tok * p.pos_stride);
}

// The cos and signed sin of token tok's position at the lane's dims c .. c + 7 as packed
// 16-bit codes (the sine's sign bit flipped in the first half, so that y = fma(n', s, n c)
// in both halves; 0 for pass-through dims and for positions outside the table, where no
// row is read). 16-byte loads when R/2 % 8 == 0 (the lane's 8 dims lie in one half).
// Shared by variants 1, 2 and 4.
__device__ __forceinline__ void rope_codes(const NriParams& p, int64_t tok, int c, int rot,
                                           uint32_t (&cw)[4], uint32_t (&sw)[4]) {
  constexpr int C = nri::kChunk;
  const int hr = rot >> 1;
#pragma unroll
  for (int k = 0; k < 4; ++k) cw[k] = sw[k] = 0;
  const int64_t pos = position_of(p, tok);
  if (pos < 0 || pos >= p.max_pos || c >= rot) return;
  const uint16_t* trow = static_cast<const uint16_t*>(p.table) + pos * p.table_stride;
  if ((hr & 7) == 0) {
    const int ci = nri::cos_chunk(c, hr);
    load8(trow + ci, cw);
    load8(trow + hr + ci, sw);
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const int ci = nri::cos_index(c + j, hr);
      const bool in = c + j < rot;
      cw[j >> 1] |= (in ? (uint32_t)trow[ci] : 0u) << (16 * (j & 1));
      sw[j >> 1] |= (in ? (uint32_t)trow[hr + ci] : 0u) << (16 * (j & 1));
    }
  }
#pragma unroll
  for (int j = 0; j < C; ++j)
    if (nri::rope_role(c + j, hr) == 0) sw[j >> 1] ^= 0x8000u << (16 * (j & 1));
}

// Registers per pass limit the loads in flight, so a lane keeps per pass only the 16 raw
// bytes of x (and of the partner x for XCHG_GLOBAL), packed in 4 words; head indices are
// recomputed, the weight (an L1 hit) and V (k heads only) are loaded when the pass is
// processed, and the cos | signed sin stay packed 16-bit. The passes are processed by a
// loop that is NOT unrolled (the store code exists once): the pass at queue index 0 is
// processed, then the queue moves down by one (register moves).
template <int ACT, int D, int ROUNDS, int XCHG>
__global__ void __launch_bounds__(kVecMaxWarps * 32, vec_min_blocks(D, ROUNDS, XCHG))
nri_vec_kernel(const NriParams p) {
  constexpr int C = nri::kChunk;
  constexpr int LPH = nri::Geo<D>::kLanesPerHead;
  constexpr int G = nri::Geo<D>::kHeadsPerPass;
  constexpr int HPW = G * ROUNDS;
  constexpr int XR = XCHG == XCHG_GLOBAL ? ROUNDS : 1;  // partner-x queue length
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int grp = lane / LPH;
  const int l = lane % LPH;
  const int c = l * C;

  const int total = (int)(p.hq + p.hkv + p.hi + p.write_ik);
  const int hpb = (int)p.heads_per_block;
  int64_t tok;
  int hb;
  nri::block_coords(blockIdx.x, blockIdx.y, (uint32_t)total, (uint32_t)hpb,
                    p.heads_fast != 0, tok, hb);
  const int h_end = min(total, (hb + 1) * hpb);
  const int first = nri::first_head(hb, hpb, warp, HPW);
  if (first >= h_end) return;  // the whole warp (uniform); no block barrier below

  const int rot = (int)p.rotary_dim;
  const int hr = rot >> 1;
  uint16_t* row = static_cast<uint16_t*>(p.rows) + tok * p.row_stride;

  uint32_t xb[ROUNDS][4], xpb[XR][4];
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r)
    load_pass<D, XCHG>(p, row, nri::round_head(first, r, grp, G), h_end, c, rot, hr, xb[r],
                       xpb[XCHG == XCHG_GLOBAL ? r : 0]);

  // Per token: cos and signed sin of the lane's dims as 16-bit codes (sign bit flipped for
  // the first half; 0 for pass-through dims and for positions outside the table, where no
  // row is read), and the slots when the block has a k / index_k head.
  uint32_t cw[4], sw[4];
  rope_codes(p, tok, c, rot, cw, sw);
  // Cache offsets of the token's slots (-1: not written): page * s0 + offset * s2.
  int64_t slot = -1, kv_base = -1, ic_base = -1;
  if (hb * hpb < p.hq + p.hkv && h_end > p.hq) {
    slot = load_index(p.slots, p.slots_is64, tok * p.slot_stride);
    if (slot >= 0 && slot < p.num_slots)
      kv_base = (slot / p.page_size) * p.kv_s0 + (slot % p.page_size) * p.kv_s2;
  }
  if (p.write_ik && h_end == total) {
    const int64_t islot = load_index(p.islots, p.islots_is64, tok * p.islot_stride);
    if (islot >= 0 && islot < p.ic_num_slots)
      ic_base = (islot / p.ic_page) * p.ic_s0 + (islot % p.ic_page) * p.ic_s1;
  }
  const float eps = (float)p.eps;

  if (XCHG == XCHG_GLOBAL) __syncwarp();  // partner reads before any in-place store
#pragma unroll 1
  for (int r = 0; r < ROUNDS; ++r) {
    const HeadRef hd = head_ref<D>(p, nri::round_head(first, r, grp, G), h_end);
    const int kind = hd.kind;
    const uint16_t* w = weight_of(p, kind);
    uint32_t wb[4], vb[4];
    load8(w + c, wb);
    if (kind == 1) load8(row + (p.hq + p.hkv + hd.h) * D + c, vb);
    // Explicitly rounded operations (no contraction left to the compiler), so that every
    // instantiation (rounds, exchange) computes the same bits.
    float x[C];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      x[j] = widen<ACT>(xb[0], j);
      ss = __fmaf_rn(x[j], x[j], ss);
    }
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1)
      ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, o));
    const float rs = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / D), eps));  // / D: exact, D = 2^k
    float n[C], np[C];
#pragma unroll
    for (int j = 0; j < C; ++j)
      n[j] = __fmul_rn(__fmul_rn(x[j], rs), __fadd_rn(1.f, widen<ACT>(wb, j)));
    if (XCHG == XCHG_SHFL) {
      nri::exchange<LPH>(n, l, hr, WarpShfl<LPH>{}, np);
    } else {
      uint32_t wpb[4];
      load_partner8(w, c, rot, hr, wpb);
#pragma unroll
      for (int j = 0; j < C; ++j)
        np[j] = __fmul_rn(__fmul_rn(widen<ACT>(xpb[0], j), rs),
                          __fadd_rn(1.f, widen<ACT>(wpb, j)));
    }
    float y[C];
#pragma unroll
    for (int j = 0; j < C; ++j)
      y[j] = nri::rope_role(c + j, hr) == 2
                 ? n[j]
                 : __fmaf_rn(np[j], widen<ACT>(sw, j), __fmul_rn(n[j], widen<ACT>(cw, j)));
    // The queue moves down: the next pass is at index 0.
#pragma unroll
    for (int q = 0; q + 1 < ROUNDS; ++q) {
#pragma unroll
      for (int k = 0; k < 4; ++k) xb[q][k] = xb[q + 1][k];
    }
#pragma unroll
    for (int q = 0; q + 1 < XR; ++q) {
#pragma unroll
      for (int k = 0; k < 4; ++k) xpb[q][k] = xpb[q + 1][k];
    }

    store_head<ACT, D>(p, hd, tok, row, c, y, vb, kv_scales(p, hd, slot, kv_base), kv_base,
                       ic_base);
  }
}

#ifdef __CUDACC__
// Dispatch over D and the rounds (one exchange and activation format per translation unit).
template <int XCHG, int ACT>
cudaError_t launch_vec(const NriParams& p, int rounds, dim3 grid, dim3 block,
                       cudaStream_t s) {
#define NRI_VEC_CASE(D)                                                                     \
  switch (rounds) {                                                                         \
    case 1: nri_vec_kernel<ACT, D, 1, XCHG><<<grid, block, 0, s>>>(p); break;               \
    case 2: nri_vec_kernel<ACT, D, 2, XCHG><<<grid, block, 0, s>>>(p); break;               \
    default: nri_vec_kernel<ACT, D, 4, XCHG><<<grid, block, 0, s>>>(p); break;              \
  }
  switch (p.head_dim) {
    case 64: NRI_VEC_CASE(64) break;
    case 128: NRI_VEC_CASE(128) break;
    default: NRI_VEC_CASE(256) break;
  }
#undef NRI_VEC_CASE
  return cudaGetLastError();
}
#endif  // __CUDACC__ (csrc/nri_vec_host.cpp runs the kernel on the CPU instead)

}  // namespace nri_dev
