// The vectorised variants (csrc/nri_vec.cuh, variants 1 and 2) run on the CPU for the tests
// (tests/test_csrc.py builds it: g++ -O0 -std=c++17 -shared -fPIC -Icsrc -I<cuda>/include):
// the kernel source unchanged, compiled against csrc/cuda_sim.h (a warp's lanes are
// coroutines of one OS thread; warps and blocks one after another). Inputs and outputs are
// host memory with the device layouts (the binding's NriParams, filled by
// kernels.cuda_norm_rope_insert.launch_params from CPU tensors), so the oracle judges the
// kernels' addressing, guards, formats and lane arithmetic before any GPU time is spent.
// Not simulated: timing, the memory model (the kernels need no ordering across warps: warps
// own disjoint heads), the hardware conversions (bit-identical to the software ones).
#include "cuda_sim.h"  // first: the built-ins the kernel source expects

#include <vector>

#include "nri_vec.cuh"

namespace {

template <int ACT, int D, int ROUNDS, int XCHG>
int run_grid(const NriParams& p) {
  const uint32_t total = (uint32_t)(p.hq + p.hkv + p.hi + p.write_ik);
  const uint32_t blocks_y = nri::head_blocks(total, (uint32_t)p.heads_per_block);
  const uint32_t gx = p.heads_fast ? (uint32_t)p.n * blocks_y : (uint32_t)p.n;
  const uint32_t gy = p.heads_fast ? 1u : blocks_y;
  const dim3 bdim((unsigned)(p.warps_per_block * 32));
  auto kernel = [&p] { nri_dev::nri_vec_kernel<ACT, D, ROUNDS, XCHG>(p); };
  std::vector<char> stacks;
  for (uint32_t by = 0; by < gy; ++by)
    for (uint32_t bx = 0; bx < gx; ++bx)
      for (int warp = 0; warp < (int)p.warps_per_block; ++warp)
        if (!cuda_sim::run_warp(kernel, make_uint3(bx, by, 0), bdim, warp, stacks)) return -3;
  return 0;
}

template <int ACT, int XCHG>
int run_act(const NriParams& p, int rounds) {
#define NRI_SIM_CASE(D)                                                                     \
  switch (rounds) {                                                                         \
    case 1: return run_grid<ACT, D, 1, XCHG>(p);                                            \
    case 2: return run_grid<ACT, D, 2, XCHG>(p);                                            \
    case 4: return run_grid<ACT, D, 4, XCHG>(p);                                            \
    default: return -1;                                                                     \
  }
  switch (p.head_dim) {
    case 64: NRI_SIM_CASE(64)
    case 128: NRI_SIM_CASE(128)
    case 256: NRI_SIM_CASE(256)
    default: return -1;
  }
#undef NRI_SIM_CASE
}

}  // namespace

extern "C" {

// Runs variant 1 or 2 on the CPU over the grid nri_launch would launch. The launch-shape
// fields must be explicit (the binding always fills them): warps_per_block, heads_per_warp
// a multiple of 256 / D with 1, 2 or 4 passes, heads_per_block = their product. Returns 0,
// -1 for an unsupported shape or variant, -3 if the warps' barriers deadlocked (lanes of a
// warp reaching different numbers of shuffles).
int nri_vec_sim_launch(const NriParams* p) {
  if (p == nullptr || (p->variant != 1 && p->variant != 2) || p->n < 0) return -1;
  const int64_t g = 256 / (p->head_dim ? p->head_dim : 1);
  const int64_t w = p->warps_per_block, hpw = p->heads_per_warp;
  if (g < 1 || (w != 1 && w != 2 && w != 4 && w != 8) || hpw < g || hpw % g ||
      p->heads_per_block != w * hpw)
    return -1;
  if (p->n == 0) return 0;
  const int rounds = (int)(hpw / g);
  const bool bf16 = p->act_fmt == cvt::FMT_BF16;
  if (p->variant == 1)
    return bf16 ? run_act<cvt::FMT_BF16, nri_dev::XCHG_SHFL>(*p, rounds)
                : run_act<cvt::FMT_F16, nri_dev::XCHG_SHFL>(*p, rounds);
  return bf16 ? run_act<cvt::FMT_BF16, nri_dev::XCHG_GLOBAL>(*p, rounds)
              : run_act<cvt::FMT_F16, nri_dev::XCHG_GLOBAL>(*p, rounds);
}
}
