// Variants 4 and 5 (csrc/nri_persist.cuh) run on the CPU for the tests (tests/test_csrc.py builds it:
// g++ -O0 -std=c++17 -shared -fPIC -Icsrc -I<cuda>/include): the kernel source unchanged,
// compiled against csrc/cuda_sim.h (a warp's lanes as coroutines meeting at every shuffle;
// warps one after another: the kernel has no block barrier and its warps own disjoint
// items). The caller picks the grid (the device takes SMs x resident blocks), so the tests
// can run the item split over 1 warp, a few, and more warps than items.
#include "cuda_sim.h"  // first: the built-ins the kernel source expects

#include <vector>

#include "nri_persist.cuh"

namespace {

template <int ACT, int D, bool SPLIT>
int run_grid(const NriParams& p, unsigned grid) {
  const dim3 bdim((unsigned)(p.warps_per_block * 32));
  auto kernel = [&p] { nri_dev::nri_persist_kernel<ACT, D, nri_dev::kPersistRounds, SPLIT>(p); };
  std::vector<char> stacks;
  for (unsigned b = 0; b < grid; ++b)
    for (int warp = 0; warp < (int)p.warps_per_block; ++warp)
      if (!cuda_sim::run_threads(kernel, make_uint3(b, 0, 0), bdim, dim3(grid),
                                 (unsigned)(warp * 32), 32, nullptr, stacks))
        return -3;
  return 0;
}

template <int ACT>
int run_act(const NriParams& p, unsigned grid) {
#define NRI_SIM_CASE(D)                                                                     \
  return persist_split(p) ? run_grid<ACT, D, true>(p, grid)                                 \
                          : run_grid<ACT, D, false>(p, grid);
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

// Runs variant 4 or 5 on the CPU over `grid` blocks. The launch-shape fields must be explicit as
// the binding fills them (warps_per_block 1, 2, 4 or 8; heads_per_warp (256 / D) x 2;
// heads_per_block their product; heads_fast 0). Returns 0, -1 for an unsupported shape,
// -3 if the lanes' barriers deadlocked (lanes of a warp reaching different shuffles).
int nri_persist_sim_launch(const NriParams* p, int64_t grid) {
  if (p == nullptr || (p->variant != 4 && p->variant != 5) || p->n < 0 || grid < 1) return -1;
  const int64_t g = 256 / (p->head_dim ? p->head_dim : 1);
  const int64_t w = p->warps_per_block, hpw = p->heads_per_warp;
  if (g < 1 || (w != 1 && w != 2 && w != 4 && w != 8) || hpw < g || hpw % g ||
      p->heads_per_block != w * hpw || p->heads_fast != 0 || p->stages != 0)
    return -1;
  const int rounds = (int)(hpw / g);
  if (rounds != nri_dev::kPersistRounds) return -1;
  if (p->n == 0) return 0;
  return p->act_fmt == cvt::FMT_BF16 ? run_act<cvt::FMT_BF16>(*p, (unsigned)grid)
                                     : run_act<cvt::FMT_F16>(*p, (unsigned)grid);
}

// nri_dev::split_aligned (variant 5's choice of its aligned split loops): 1 or 0.
int nri_persist_split_aligned(const NriParams* p) {
  return p != nullptr && nri_dev::split_aligned(*p) ? 1 : 0;
}
}
