// Fused Gemma RMSNorm + partial NeoX RoPE + paged KV / index-cache insert (contract.md sections
// 3 and 4): the CUDA twin of kernels/norm_rope_insert.py, same contract.
//
// nri_launch picks one of five kernels by NriParams::variant (all compute the same
// function; the knobs only change speed; variant 5 is variant 4's kernel):
//   0  this file's kernel, described below: a warp per head (the verified fallback);
//   1  csrc/nri_vec.cuh with XCHG_SHFL: 16-byte lanes (8 dims per lane, 256 / D heads per
//      warp instruction), 1, 2 or 4 such passes per warp with every x load issued first,
//      RoPE partners by warp shuffles, no shared memory;
//   2  csrc/nri_vec.cuh with XCHG_GLOBAL: as 1, partners re-read from global memory;
//   3  csrc/nri_stream.cuh: persistent blocks owning whole tokens, the rows copied into a
//      pipeline of shared-memory stages by cp.async, the 16-byte lane arithmetic of 1 and 2
//      (the same bits as 1 and 2); rows, table or slots misaligned for cp.async, or rows too
//      wide for two stages with the default stage count, run variant 1 instead;
//   4  csrc/nri_persist.cuh: persistent warps walking contiguous ranges of (token, head
//      chunk) items, the q heads apart from the others (1 + w_q and the token's cos / sin
//      kept in registers), the lanes and shuffles of 1 (the same bits as 1-3);
//   5  variant 4 with every head in split lanes when R = D / 2 (csrc/nri_persist.cuh,
//      csrc/nri_split.cuh: a lane holds both halves of its RoPE pairs and 8 pass-through
//      dims, no partner shuffles; the other heads in one loop per kind); other R:
//      variant 4.
// Variants 1-4 give identical bits; variant 0 sums the squares in another order (D / 32
// dims per lane, a 32-lane butterfly), and variant 5 every head's when R = D / 2 (16 dims
// per lane, a D / 16-lane butterfly), so they may differ from them by an fp32 rounding.
// heads_fast (variants 0-2) launches a 1-D grid with a token's head blocks adjacent instead
// of the (N, head blocks) grid.
//
// Variant 0: grid (N, ceil(heads / heads_per_block)), 4 warps per block. A token's heads are
// enumerated q (Hq), k (Hkv), index_q (Hi), index_k (1, when written); a block owns
// heads_per_block consecutive ones and each warp one head at a time (lane l holds dims
// l*VEC .. l*VEC+VEC-1, VEC = D/32). The block first loads the token's cos|sin table row
// into shared memory (fp32; zeros when the position is outside the table: no row is read).
//
// Per head, in fp32: n = (x * rsqrt(sum(x^2) / D + eps)) * (1 + w); the warp writes n to
// shared memory and each lane reads the rotate-half partner of its dims from there (d + R/2
// for d < R/2, d - R/2 for R/2 <= d < R), so any even R <= D works (no lane-XOR pairing).
// y = n*c - n'*s / n*c + n'*s; dims >= R pass through. Outputs:
//   q        -> q_out (strided; may be the rows themselves), rounded once (RNE) to the model dtype
//   k        -> in place in the rows (model dtype), and into the cache from its fp32 value
//               (one rounding): fp8 code of y / k_scale (satfinite), or y rounded to the cache
//               dtype; V from its model-dtype value (/ v_scale for fp8; bit copy when the
//               cache has the activation dtype)
//   index_q  -> iq_out: model dtype, or e4m3 codes (satfinite, unit scale) of the fp32 value
//   index_k  -> in place in the rows, and into the index cache at its own slot (the same bits
//               as the output for a model-dtype index cache; e4m3 codes of the fp32 value)
// Caches are addressed through their strides with 64-bit offsets; negative and out-of-range
// slots write nothing. A warp loads its whole head before any lane stores (__syncwarp), and
// different warps own different heads, so the in-place writes cannot race.
//
// fp32 arithmetic: correctly rounded + - * and / (no fast math), rsqrtf (2 ulp), FMA
// contraction allowed: what oracle.bounds.Fp32Arith's defaults declare.

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp8_convert.h"
#include "norm_rope_insert.h"
#include "nri_device.cuh"
#include "nri_lanes.h"
#include "nri_stream.cuh"

namespace {

using namespace nri_dev;

constexpr int kWarps = 4;
constexpr int kMaxRotary = 256;

// 12 blocks of 4 warps per SM: <= 40 registers (no spills at D = 64/128; a few bytes at 256).
template <int ACT, int D>
__global__ void __launch_bounds__(kWarps * 32, 12) nri_kernel(const NriParams p) {
  constexpr int VEC = D / 32;
  __shared__ float cs[kMaxRotary];   // cos_0..cos_{R/2-1} | sin_0..sin_{R/2-1}
  __shared__ float nb[kWarps][D];    // each warp's normalised head, for the partner lanes

  const int64_t total = p.hq + p.hkv + p.hi + p.write_ik;
  int64_t tok;
  int hb;
  nri::block_coords(blockIdx.x, blockIdx.y, (uint32_t)total, (uint32_t)p.heads_per_block,
                    p.heads_fast != 0, tok, hb);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rot = (int)p.rotary_dim;
  const int hr = rot / 2;

  const int64_t pos = load_index(p.positions, p.pos_is64, tok * p.pos_stride);
  const bool pos_ok = pos >= 0 && pos < p.max_pos;
  if (pos_ok) {
    const uint16_t* trow = static_cast<const uint16_t*>(p.table) + pos * p.table_stride;
    for (int i = threadIdx.x; i < rot; i += blockDim.x) cs[i] = cvt::half_to_f32(trow[i], ACT);
  } else {
    for (int i = threadIdx.x; i < rot; i += blockDim.x) cs[i] = 0.f;
  }
  __syncthreads();

  uint16_t* row = static_cast<uint16_t*>(p.rows) + tok * p.row_stride;
  const float eps = (float)p.eps;
  const int64_t h_end = min(total, ((int64_t)hb + 1) * p.heads_per_block);
  const int d0 = lane * VEC;

  for (int64_t t = (int64_t)hb * p.heads_per_block + warp; t < h_end; t += kWarps) {
    // Which head of which kind, where it lives in the row, its weight.
    int kind;  // 0 q, 1 k, 2 index_q, 3 index_k
    int64_t h, col;
    const void* w;
    if (t < p.hq) {
      kind = 0, h = t, col = h * D, w = p.w_q;
    } else if (t < p.hq + p.hkv) {
      kind = 1, h = t - p.hq, col = (p.hq + h) * D, w = p.w_k;
    } else if (t < p.hq + p.hkv + p.hi) {
      kind = 2, h = t - p.hq - p.hkv, col = (p.hq + 2 * p.hkv + h) * D, w = p.w_iq;
    } else {
      kind = 3, h = 0, col = p.ik_col, w = p.w_ik;
    }

    uint16_t xb[VEC], wb[VEC];
    load_n<VEC>(row + col + d0, xb);
    load_n<VEC>(static_cast<const uint16_t*>(w) + d0, wb);
    float x[VEC];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      x[j] = cvt::half_to_f32(xb[j], ACT);
      ss += x[j] * x[j];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    const float r = rsqrtf(ss / (float)D + eps);
    float n[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      n[j] = (x[j] * r) * (1.f + cvt::half_to_f32(wb[j], ACT));
      nb[warp][d0 + j] = n[j];
    }
    __syncwarp();
    float y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int d = d0 + j;
      if (d < hr) {
        y[j] = n[j] * cs[d] + (-nb[warp][d + hr]) * cs[hr + d];
      } else if (d < rot) {
        y[j] = n[j] * cs[d - hr] + nb[warp][d - hr] * cs[d];
      } else {
        y[j] = n[j];
      }
    }
    __syncwarp();  // every lane has read nb (and loaded its x) before anyone writes

    if (kind == 0) {
      uint16_t ob[VEC];
      round_n<ACT>(y, ob);
      store_n<VEC>(static_cast<uint16_t*>(p.q_out) + tok * p.q_s0 + h * p.q_s1 + d0, ob);
    } else if (kind == 2) {
      const int64_t off = tok * p.iq_s0 + h * p.iq_s1 + d0;
      if (cvt::is_fp8((int)p.iq_fmt)) {
        uint8_t cb[VEC];
        encode_n(y, (int)p.iq_fmt, cb);
        store_n<VEC>(static_cast<uint8_t*>(p.iq_out) + off, cb);
      } else {
        uint16_t ob[VEC];
        round_n<ACT>(y, ob);
        store_n<VEC>(static_cast<uint16_t*>(p.iq_out) + off, ob);
      }
    } else if (kind == 1) {
      uint16_t ob[VEC], vb[VEC];
      round_n<ACT>(y, ob);
      load_n<VEC>(row + (p.hq + p.hkv + h) * D + d0, vb);
      store_n<VEC>(row + col + d0, ob);
      const int64_t slot = load_index(p.slots, p.slots_is64, tok * p.slot_stride);
      if (slot >= 0 && slot < p.num_slots) {
        const int64_t page = slot / p.page_size, off = slot % p.page_size;
        const int64_t base = page * p.kv_s0 + h * p.kv_s1 + off * p.kv_s2 + d0;
        const int fmt = (int)p.kv_fmt;
        if (cvt::is_fp8(fmt)) {
          const float ks = p.k_scale[h * p.ks_s0 + slot * p.ks_s1];
          const float vs = p.v_scale[h * p.vs_s0 + slot * p.vs_s1];
          float kq[VEC], vq[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            kq[j] = y[j] / ks;
            vq[j] = cvt::half_to_f32(vb[j], ACT) / vs;
          }
          uint8_t kc[VEC], vc[VEC];
          encode_n(kq, fmt, kc);
          encode_n(vq, fmt, vc);
          uint8_t* dst = static_cast<uint8_t*>(p.kv) + base;
          store_n<VEC>(dst, kc);
          store_n<VEC>(dst + D, vc);
        } else {
          uint16_t kc[VEC], vc[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            kc[j] = cvt::half_from_f32(y[j], fmt);
            vc[j] = fmt == ACT ? vb[j] : cvt::half_from_f32(cvt::half_to_f32(vb[j], ACT), fmt);
          }
          uint16_t* dst = static_cast<uint16_t*>(p.kv) + base;
          store_n<VEC>(dst, kc);
          store_n<VEC>(dst + D, vc);
        }
      }
    } else {
      uint16_t ob[VEC];
      round_n<ACT>(y, ob);
      store_n<VEC>(row + col + d0, ob);
      const int64_t slot = load_index(p.islots, p.islots_is64, tok * p.islot_stride);
      if (slot >= 0 && slot < p.ic_num_slots) {
        const int64_t base = (slot / p.ic_page) * p.ic_s0 + (slot % p.ic_page) * p.ic_s1 + d0;
        if (cvt::is_fp8((int)p.ic_fmt)) {
          uint8_t cb[VEC];
          encode_n(y, (int)p.ic_fmt, cb);
          store_n<VEC>(static_cast<uint8_t*>(p.ic) + base, cb);
        } else {
          store_n<VEC>(static_cast<uint16_t*>(p.ic) + base, ob);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------ launch

template <int ACT>
cudaError_t launch_act(const NriParams& p, dim3 grid, dim3 block, cudaStream_t s) {
  switch (p.head_dim) {
    case 64: nri_kernel<ACT, 64><<<grid, block, 0, s>>>(p); break;
    case 128: nri_kernel<ACT, 128><<<grid, block, 0, s>>>(p); break;
    default: nri_kernel<ACT, 256><<<grid, block, 0, s>>>(p); break;
  }
  return cudaGetLastError();
}

bool valid_fmt(int64_t f, bool fp8_ok, int64_t act) {
  return (fp8_ok && cvt::is_fp8((int)f)) || f == cvt::FMT_BF16 || f == cvt::FMT_F16 ||
         f == act;
}

}  // namespace

extern "C" int nri_launch(const NriParams* p, void* stream) {
  if (p == nullptr) return (int)cudaErrorInvalidValue;
  NriParams q = *p;
  const bool ok =
      q.n >= 0 && q.n <= 0x7FFFFFFF && (q.act_fmt == cvt::FMT_BF16 || q.act_fmt == cvt::FMT_F16) &&
      (q.head_dim == 64 || q.head_dim == 128 || q.head_dim == 256) && q.rotary_dim >= 2 &&
      q.rotary_dim % 2 == 0 && q.rotary_dim <= q.head_dim && q.hq >= 1 && q.hkv >= 1 &&
      q.hi >= 0 && (q.write_ik == 0 || q.write_ik == 1) && q.heads_per_block >= 1 &&
      q.page_size >= 1 && q.ic_page >= 1 && valid_fmt(q.kv_fmt, true, q.act_fmt) &&
      valid_fmt(q.iq_fmt, true, q.act_fmt) && valid_fmt(q.ic_fmt, true, q.act_fmt) &&
      q.variant >= 0 && q.variant <= 5 && (q.heads_fast == 0 || q.heads_fast == 1) &&
      (q.stages == 0 || (q.variant == 3 && q.stages >= 2 && q.stages <= kStreamMaxStages));
  if (!ok) return (int)cudaErrorInvalidValue;
  // The kernels count heads, head blocks and row columns in 32 bits.
  const int64_t total = q.hq + q.hkv + q.hi + q.write_ik;
  if (total >= (1 << 24) || q.heads_per_block >= (1 << 24) || q.ik_col < 0 ||
      (total + q.hkv) * q.head_dim >= ((int64_t)1 << 31) || q.ik_col >= ((int64_t)1 << 31))
    return (int)cudaErrorInvalidValue;
  // Launch shape; 0 means the variant's default. Variant 0: 4 warps per block, one head per
  // warp at a time, any heads_per_block (the warps loop). Variants 1, 2: 1, 2, 4 or 8 warps
  // per block (default 2), G * {1, 2, 4} heads per warp (G = 256 / D heads per 16-byte
  // pass; default 2 G), heads_per_block = warps * heads per warp (no loop). Variant 3: the
  // warp choices with 4 by default (a block's pass over a token's heads), 2 G heads per warp
  // only (kStreamRounds), the (N, head blocks) grid order only (its grid is persistent),
  // 2 .. 8 stages (default: 3, fewer when the rows are too wide for the shared memory).
  // Variants 4, 5: the warp choices of 1 and 2 (default kPersistDefaultWarps), 2 G heads
  // per warp only (kPersistRounds), the default grid order only (persistent). (Variants
  // 3-5 compile one pass count each: csrc/nri_device.cuh, the cold build's time.)
  const int64_t g = 256 / q.head_dim;
  int rounds = 0;
  if (q.variant == 0) {
    if (q.warps_per_block == 0) q.warps_per_block = kWarps;
    if (q.heads_per_warp == 0) q.heads_per_warp = 1;
    if (q.warps_per_block != kWarps || q.heads_per_warp != 1) return (int)cudaErrorInvalidValue;
  } else {
    if (q.warps_per_block == 0)
      q.warps_per_block = q.variant == 3   ? kStreamDefaultWarps
                          : q.variant >= 4 ? kPersistDefaultWarps
                                           : 2;
    if (q.heads_per_warp == 0)
      q.heads_per_warp = (q.variant >= 4 ? kPersistRounds : 2) * g;
    const int64_t w = q.warps_per_block, r = q.heads_per_warp / g;
    if ((w != 1 && w != 2 && w != 4 && w != kVecMaxWarps) || q.heads_per_warp % g != 0 ||
        (r != 1 && r != 2 && r != 4) || (q.variant >= 4 && r != kPersistRounds) ||
        (q.variant == 3 && r != kStreamRounds) ||
        q.heads_per_block != w * q.heads_per_warp ||
        (q.variant >= 3 && q.heads_fast != 0))
      return (int)cudaErrorInvalidValue;
    rounds = (int)r;
  }
  if (q.n == 0) return (int)cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool bf16 = q.act_fmt == cvt::FMT_BF16;
  if (q.variant >= 4) {
    using Entry = cudaError_t (*)(const NriParams&, int, cudaStream_t);
    const int di = q.head_dim == 64 ? 0 : q.head_dim == 128 ? 1 : 2;
    static const Entry kEntries[2][2][3] = {
        {{nri_launch_persist_bf16_d64, nri_launch_persist_bf16_d128, nri_launch_persist_bf16_d256},
         {nri_launch_persist_f16_d64, nri_launch_persist_f16_d128, nri_launch_persist_f16_d256}},
        {{nri_launch_split_bf16_d64, nri_launch_split_bf16_d128, nri_launch_split_bf16_d256},
         {nri_launch_split_f16_d64, nri_launch_split_f16_d128, nri_launch_split_f16_d256}}};
    return (int)kEntries[persist_split(q) ? 1 : 0][bf16 ? 0 : 1][di](q, rounds, s);
  }
  if (q.variant == 3) {
    int sms = 0, optin = 0;
    const cudaError_t e = stream_device_limits(&sms, &optin);
    if (e != cudaSuccess) return (int)e;
    const auto fits = [&](int64_t stages) {
      return stream_smem_bytes(q, q.warps_per_block, rounds, stages) <= optin;
    };
    bool stream_ok = stream_eligible(q);
    if (q.stages != 0) {
      if (!fits(q.stages)) return (int)cudaErrorInvalidValue;
    } else {
      int64_t st = kStreamDefaultStages;
      while (st >= 2 && !fits(st)) --st;
      stream_ok = stream_ok && st >= 2;
      q.stages = st;
    }
    if (stream_ok) {
      using Entry = cudaError_t (*)(const NriParams&, int, cudaStream_t);
      const int di = q.head_dim == 64 ? 0 : q.head_dim == 128 ? 1 : 2;
      static const Entry kEntries[2][3] = {
          {nri_launch_stream_bf16_d64, nri_launch_stream_bf16_d128, nri_launch_stream_bf16_d256},
          {nri_launch_stream_f16_d64, nri_launch_stream_f16_d128, nri_launch_stream_f16_d256}};
      return (int)kEntries[bf16 ? 0 : 1][di](q, rounds, s);
    }
    // Variant 1 with its default shape: the same bits.
    q.variant = 1, q.warps_per_block = 2, q.heads_per_warp = 2 * g;
    q.heads_per_block = 4 * g, q.stages = 0, rounds = 2;
  }
  const int64_t blocks_y = nri::head_blocks((uint32_t)total, (uint32_t)q.heads_per_block);
  dim3 grid;
  if (q.heads_fast) {
    if (q.n * blocks_y > 0x7FFFFFFF) return (int)cudaErrorInvalidValue;
    grid = dim3((unsigned)(q.n * blocks_y));
  } else {
    if (blocks_y > 65535) return (int)cudaErrorInvalidValue;
    grid = dim3((unsigned)q.n, (unsigned)blocks_y);
  }
  const dim3 block((unsigned)(q.warps_per_block * 32));
  cudaError_t err;
  if (q.variant == 0) {
    err = bf16 ? launch_act<cvt::FMT_BF16>(q, grid, block, s)
               : launch_act<cvt::FMT_F16>(q, grid, block, s);
  } else if (q.variant == 1) {
    err = bf16 ? nri_launch_vec_shfl_bf16(q, rounds, grid, block, s)
               : nri_launch_vec_shfl_f16(q, rounds, grid, block, s);
  } else {
    err = bf16 ? nri_launch_vec_global_bf16(q, rounds, grid, block, s)
               : nri_launch_vec_global_f16(q, rounds, grid, block, s);
  }
  return (int)err;
}

extern "C" int64_t nri_stream_smem_bytes(const NriParams* p) {
  if (p == nullptr || p->head_dim < 64 || p->head_dim > 256) return -1;
  const int64_t g = 256 / p->head_dim;
  const int64_t w = p->warps_per_block ? p->warps_per_block : kStreamDefaultWarps;
  const int64_t r = p->heads_per_warp ? p->heads_per_warp / g : 2;
  return stream_smem_bytes(*p, w, r, p->stages ? p->stages : kStreamDefaultStages);
}

extern "C" int nri_device_smem_optin(int64_t* bytes) {
  int sms = 0, optin = 0;
  const cudaError_t e = stream_device_limits(&sms, &optin);
  if (bytes) *bytes = optin;
  return (int)e;
}

extern "C" const char* nri_params_fields(void) {
#define NRI_DESCRIBE_FIELD(type, name) #type ":" #name ","
  return NRI_PARAMS_FIELDS(NRI_DESCRIBE_FIELD);
#undef NRI_DESCRIBE_FIELD
}

extern "C" int64_t nri_params_size(void) { return (int64_t)sizeof(NriParams); }

extern "C" const char* csrc_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
