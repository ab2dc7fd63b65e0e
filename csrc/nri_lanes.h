// Lane geometry of the fused insert's vectorised variants (csrc/norm_rope_insert.cu,
// variants 1 and 2): which lane holds which dims of which head, where a dim's RoPE partner
// comes from, and which blocks own which heads. __host__ __device__ and free of CUDA
// headers, so that the CPU tests (tests/test_csrc.py, through csrc/nri_lanes_host.cpp built
// with g++) simulate a warp with exactly this code, exhaustively over every even R <= D.
//
// The 16-byte layout: a lane holds kChunk = 8 contiguous dims (16 bytes of bf16/fp16) of one
// head, c = 8 l .. c + 7 for lane l of its head's group; a head takes LPH = D / 8 lanes
// (8, 16, 32 for D = 64, 128, 256), a warp holds G = 32 / LPH heads per instruction
// (group g = lane / LPH, lanes g*LPH .. g*LPH + LPH - 1).
//
// RoPE partner of dim d (contract.md s.3, rotate half, hr = R/2): d + hr for d < hr, d - hr for
// hr <= d < R, none for d >= R. With hr = 8 a + b (0 <= b < 8), element j of lane l (dim
// d = 8 l + j) finds its partner
//   d < hr:       at dim 8 (l + a) + j + b : element (j + b) & 7 of lane l + a + (j + b >= 8)
//   hr <= d < R:  at dim 8 (l - a) + j - b : element (j - b) & 7 of lane l - a - (j < b)
// Both lanes lie in [0, LPH) whenever d < R (the partner is a dim of the same head, and
// 0 <= partner < R <= D), so the exchange never leaves the head's lane group. A shuffle sends
// ONE register index per instruction (uniform over the warp), so for each j the exchange
// shuffles element (j + b) & 7 for the first half and (j - b) & 7 for the second half: one
// shuffle when those coincide (b = 0 or 4: the per-lane source lane picks the half), two
// otherwise. b is uniform over the launch; exchange() dispatches it to a compile-time B.
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define NRI_HD __host__ __device__ __forceinline__
#else
#define NRI_HD inline
#endif
#ifdef __CUDA_ARCH__
#define NRI_UNROLL _Pragma("unroll")
#else
#define NRI_UNROLL
#endif

namespace nri {

constexpr int kChunk = 8;  // dims per lane in the 16-byte layout

// Lanes per head and heads per warp instruction of the 16-byte layout.
template <int D>
struct Geo {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static constexpr int kLanesPerHead = D / kChunk;      // 8, 16, 32
  static constexpr int kHeadsPerPass = 32 / kLanesPerHead;  // 4, 2, 1
};

// RoPE role of dim d: 0 first half (y = n c - n' s), 1 second half (y = n c + n' s),
// 2 pass-through (y = n).
NRI_HD int rope_role(int d, int hr) { return d < hr ? 0 : (d < 2 * hr ? 1 : 2); }

// The partner dim of d (d itself for pass-through dims).
NRI_HD int partner_dim(int d, int hr) {
  return d < hr ? d + hr : (d < 2 * hr ? d - hr : d);
}

// Index of the cos of dim d in the table row (d < R); its sin is at hr + cos_index.
NRI_HD int cos_index(int d, int hr) { return d < hr ? d : d - hr; }

// hr % 8 == 0: a lane's 8 dims (c % 8 == 0, c < R) lie in one half, their partners are the
// 8 contiguous dims from partner_chunk and their cos the 8 from cos_chunk.
NRI_HD int partner_chunk(int c, int hr) { return c < hr ? c + hr : c - hr; }
NRI_HD int cos_chunk(int c, int hr) { return c < hr ? c : c - hr; }

// Element j of lane l (of LPH lanes), hr = 8 a + B: fills np[j] with the normalised value
// of its partner dim (n, the lane's own 8 normalised values). shfl(n, k, src) returns
// element k of n held by lane src (0 <= src < LPH) of the caller's lane group: on the
// device a __shfl_sync over the full warp with width LPH, on the host the simulation's
// lookup. Every lane of the warp must call it (the device shuffles are collective).
// Elements of pass-through dims receive a value that is never used.
template <int B, int LPH, class Shfl>
NRI_HD void exchange_b(const float (&n)[kChunk], int l, int a, int hr, const Shfl& shfl,
                       float (&np)[kChunk]) {
  static_assert(B >= 0 && B < kChunk, "B = hr % 8");
  constexpr int kMask = LPH - 1;
  const int c = l * kChunk;
NRI_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    const int kp = (j + B) & 7;                                   // first-half sender element
    const int km = (j - B + kChunk) & 7;                         // second-half one
    const int sp = (j + B < kChunk ? l + a : l + a + 1) & kMask;  // first-half source lane
    const int sm = (j < B ? l - a - 1 : l - a) & kMask;           // second-half source lane
    const bool first = c + j < hr;
    if (kp == km) {  // B = 0 or 4 (compile-time after unrolling): one shuffle
      np[j] = shfl(n, kp, first ? sp : sm);
    } else {
      const float vp = shfl(n, kp, sp);
      const float vm = shfl(n, km, sm);
      np[j] = first ? vp : vm;
    }
  }
}

template <int LPH, class Shfl>
NRI_HD void exchange(const float (&n)[kChunk], int l, int hr, const Shfl& shfl,
                     float (&np)[kChunk]) {
  const int a = hr >> 3;
  switch (hr & 7) {  // uniform over the launch: no divergence
    case 0: exchange_b<0, LPH>(n, l, a, hr, shfl, np); break;
    case 1: exchange_b<1, LPH>(n, l, a, hr, shfl, np); break;
    case 2: exchange_b<2, LPH>(n, l, a, hr, shfl, np); break;
    case 3: exchange_b<3, LPH>(n, l, a, hr, shfl, np); break;
    case 4: exchange_b<4, LPH>(n, l, a, hr, shfl, np); break;
    case 5: exchange_b<5, LPH>(n, l, a, hr, shfl, np); break;
    case 6: exchange_b<6, LPH>(n, l, a, hr, shfl, np); break;
    default: exchange_b<7, LPH>(n, l, a, hr, shfl, np); break;
  }
}

// ------------------------------------------------------------------------ head ownership
//
// A token's heads are enumerated q (Hq), k (Hkv), index_q (Hi), index_k (0 or 1): `total`.
// Head block hb owns heads [hb * hpb, min(total, (hb + 1) * hpb)) (hpb = heads_per_block).
// Grid: heads_fast = 0 is (N, blocks_y) with blockIdx.x the token (one head block's tokens
// are adjacent in launch order: the original kernel's grid); heads_fast = 1 is 1-D over
// N * blocks_y with a token's head blocks adjacent (the rows are walked in memory order).

// 32-bit arithmetic (nri_launch checks total, hpb < 2^24 and N * blocks_y < 2^31).
NRI_HD uint32_t head_blocks(uint32_t total, uint32_t hpb) { return (total + hpb - 1) / hpb; }

NRI_HD void block_coords(uint32_t bx, uint32_t by, uint32_t total, uint32_t hpb,
                         bool heads_fast, int64_t& tok, int& hb) {
  if (heads_fast) {
    const uint32_t blocks_y = head_blocks(total, hpb);
    const uint32_t t = bx / blocks_y;
    tok = t;
    hb = (int)(bx - t * blocks_y);
  } else {
    tok = bx;
    hb = (int)by;
  }
}

// Vectorised variants: a block of wpb warps owns hpb = wpb * hpw heads; warp w takes the
// hpw = G * rounds heads from first_head(...), round r and lane group g the head
// round_head(first, r, g, G) (valid when below the block's end).
NRI_HD int first_head(int hb, int hpb, int warp, int hpw) { return hb * hpb + warp * hpw; }

NRI_HD int round_head(int first, int round, int group, int heads_per_pass) {
  return first + round * heads_per_pass + group;
}

// Variant 4 (csrc/nri_persist.cuh): a token's q heads form ceil(hq / hpw) items, its other
// heads (k, index_q, index_k: `rest`) ceil(rest / hpw), hpw heads per warp and item.
NRI_HD int persist_items_per_token(int64_t hq, int64_t rest, int hpw) {
  return (int)((hq + hpw - 1) / hpw + (rest + hpw - 1) / hpw);
}

// Blocks of wpb warps in variant 4's grid: enough for one item per warp (at least one
// block), at most `cap` (the device's resident blocks).
NRI_HD int64_t persist_grid(int64_t cap, int64_t items, int64_t wpb) {
  const int64_t need = (items + wpb - 1) / wpb;
  const int64_t g = need < cap ? need : cap;
  return g > 1 ? g : 1;
}

// Warp gw of nw takes items [begin, end) of n_items: an even split (the first n_items % nw
// warps one more), in 64 bits without overflow.
NRI_HD void persist_range(int64_t n_items, int64_t nw, int64_t gw, int64_t& begin,
                          int64_t& end) {
  const int64_t q = n_items / nw, r = n_items % nw;
  begin = gw * q + (gw < r ? gw : r);
  end = begin + q + (gw < r ? 1 : 0);
}

// A warp's strided walk over (token, sub) positions, `per` positions per token: it starts at
// position `first` and advances `step` positions at a time (the divisions once, then a
// carry per step).
struct StridedWalk {
  int64_t tok, dt;
  int sub, ds, per;
  NRI_HD StridedWalk(int64_t first, int64_t step, int per_token)
      : tok(first / per_token), dt(step / per_token), sub((int)(first - tok * per_token)),
        ds((int)(step - dt * per_token)), per(per_token) {}
  NRI_HD void next() {
    tok += dt;
    sub += ds;
    if (sub >= per) {
      sub -= per;
      ++tok;
    }
  }
};

// page * s0 + offset * s_in of a slot (>= 0) in pages of `page` slots: 32-bit division when
// both fit (a 64-bit division is a long software routine on the GPU).
NRI_HD int64_t page_offset(int64_t slot, int64_t page, int64_t s0, int64_t s_in) {
  if (slot < 0x80000000ll && page < 0x80000000ll) {
    const uint32_t pg = (uint32_t)slot / (uint32_t)page;
    return (int64_t)pg * s0 + (int64_t)((uint32_t)slot - pg * (uint32_t)page) * s_in;
  }
  return (slot / page) * s0 + (slot % page) * s_in;
}

}  // namespace nri
