// Host simulation of the vectorised variants' lane arithmetic (csrc/nri_lanes.h), built
// with g++ by tests/test_csrc.py (g++ -O2 -shared -fPIC -Icsrc): the same header code the
// kernels run, with the warp shuffle replaced by a lookup into every lane's registers.
// The tests compare the results with contract.md's partner rule, exhaustively over every even
// R <= D for D = 64, 128, 256.
#include <stdint.h>

#include "nri_lanes.h"

namespace {

constexpr int C = nri::kChunk;

// __shfl_sync(FULL, n[k], src, LPH) for the lane in group `grp`: element k of lane
// grp * LPH + src. A source outside [0, LPH) (which the kernels never pass) is recorded.
struct HostShfl {
  const float (*all)[C];
  int grp, lph;
  bool* bad;
  float operator()(const float (&)[C], int k, int src) const {
    if (src < 0 || src >= lph || k < 0 || k >= C) {
      *bad = true;
      return -1.f;
    }
    return all[grp * lph + src][k];
  }
};

template <int D>
int sim_exchange(int rot, int32_t* got) {
  constexpr int LPH = nri::Geo<D>::kLanesPerHead;
  const int hr = rot / 2;
  float n[32][C];
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < C; ++j)  // value = group * D + dim: exact in fp32
      n[lane][j] = (float)((lane / LPH) * D + (lane % LPH) * C + j);
  bool bad = false;
  for (int lane = 0; lane < 32; ++lane) {
    const int grp = lane / LPH, l = lane % LPH;
    float np[C];
    nri::exchange<LPH>(n[lane], l, hr, HostShfl{n, grp, LPH, &bad}, np);
    for (int j = 0; j < C; ++j) {
      const int d = l * C + j;
      got[grp * D + d] = nri::rope_role(d, hr) == 2 ? -1 : (int32_t)np[j];
    }
  }
  return bad ? -1 : 0;
}

}  // namespace

extern "C" {

// One warp of the shuffle exchange (variant 1) for head_dim d: got[g * d + dim] is the
// value lane group g received as the partner of dim (encoded group * d + dim of the
// sender; -1 for pass-through dims). Returns 0, -1 if a shuffle source left the lane group,
// -2 for an unsupported d.
int nri_sim_exchange(int d, int rot, int32_t* got) {
  switch (d) {
    case 64: return sim_exchange<64>(rot, got);
    case 128: return sim_exchange<128>(rot, got);
    case 256: return sim_exchange<256>(rot, got);
    default: return -2;
  }
}

// Per dim of one head (the kernels' branches for lane l = dim / 8, element dim % 8):
// role (0 first half, 1 second half, 2 pass-through), the table index of its cos and of its
// sin (-1 when none is read), and the dim variant 2 reads as its partner (-1 when none).
void nri_sim_dims(int d, int rot, int32_t* role, int32_t* cos_at, int32_t* sin_at,
                  int32_t* partner_at) {
  const int hr = rot / 2;
  for (int c = 0; c < d; c += C) {
    for (int j = 0; j < C; ++j) {
      const int dim = c + j;
      role[dim] = nri::rope_role(dim, hr);
      cos_at[dim] = sin_at[dim] = partner_at[dim] = -1;
      if (c >= rot) continue;  // the kernels read nothing for this lane
      if ((hr & 7) == 0) {     // 16-byte reads of whole chunks
        const int ci = nri::cos_chunk(c, hr);
        cos_at[dim] = ci + j;
        sin_at[dim] = hr + ci + j;
        partner_at[dim] = nri::partner_chunk(c, hr) + j;
      } else if (dim < rot) {  // element reads
        cos_at[dim] = nri::cos_index(dim, hr);
        sin_at[dim] = hr + nri::cos_index(dim, hr);
        partner_at[dim] = nri::partner_dim(dim, hr);
      }
    }
  }
}

// Head ownership of variants 1 and 2 over a whole grid of n tokens (both grid orders):
// count[tok * total + head] += 1 for every (token, head) some lane group processes, with
// heads_per_block = wpb * hpw (hpw = g * rounds), as nri_launch configures them.
void nri_sim_heads(int n, int total, int wpb, int hpw, int g, int heads_fast,
                   int32_t* count) {
  const int hpb = wpb * hpw, rounds = hpw / g;
  const uint32_t blocks_y = nri::head_blocks((uint32_t)total, (uint32_t)hpb);
  const uint32_t gx = heads_fast ? (uint32_t)n * blocks_y : (uint32_t)n;
  const uint32_t gy = heads_fast ? 1u : blocks_y;
  for (uint32_t by = 0; by < gy; ++by) {
    for (uint32_t bx = 0; bx < gx; ++bx) {
      int64_t tok;
      int hb;
      nri::block_coords(bx, by, (uint32_t)total, (uint32_t)hpb, heads_fast != 0, tok, hb);
      const int h_end = total < (hb + 1) * hpb ? total : (hb + 1) * hpb;
      for (int warp = 0; warp < wpb; ++warp) {
        const int first = nri::first_head(hb, hpb, warp, hpw);
        if (first >= h_end) continue;
        for (int r = 0; r < rounds; ++r)
          for (int grp = 0; grp < g; ++grp) {
            const int t = nri::round_head(first, r, grp, g);
            if (t < h_end) count[tok * total + t] += 1;
          }
      }
    }
  }
}

// nri::page_offset for n (slot, page) pairs: out[i] = page * s0 + offset * s_in.
void nri_sim_page_offset(int64_t n, const int64_t* slot, const int64_t* page, int64_t s0,
                         int64_t s_in, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = nri::page_offset(slot[i], page[i], s0, s_in);
}
}
