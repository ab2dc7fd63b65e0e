// Variant 3 (csrc/nri_stream.cuh) run on the CPU for the tests (tests/test_csrc.py builds it:
// g++ -O0 -std=c++17 -shared -fPIC -Icsrc -I<cuda>/include): the kernel source unchanged,
// compiled against csrc/cuda_sim.h, which runs a whole block's lanes as coroutines of one
// OS thread (warp shuffles and __syncwarp meet per warp, __syncthreads per block) with a
// host buffer as the block's dynamic shared memory; blocks one after another. The cp.async
// copies complete at once (a memcpy, zero-filled past the source bytes), so the simulation
// judges the pipeline's stage indexing, the copies' addressing, the block barriers'
// placement (the scheduler alternates the warps' order, so a warp running ahead into a
// stage others still read shows), guards, formats and lane arithmetic; not the timing,
// the asynchrony of the copies or the occupancy query (the caller picks the grid).
#include "cuda_sim.h"  // first: the built-ins the kernel source expects

#include <vector>

#include "nri_stream.cuh"

namespace {

template <int ACT, int D, int U>
int run_grid(const NriParams& p, unsigned grid) {
  const int threads = (int)p.warps_per_block * 32;
  const int64_t smem = nri_dev::stream_smem_bytes(p, p.warps_per_block, U, p.stages);
  // Shared memory starts as a NaN pattern: a read of a byte no copy wrote shows.
  std::vector<uint4> buf((size_t)(smem + 15) / 16);
  auto kernel = [&p] { nri_dev::nri_stream_kernel<ACT, D, U>(p); };
  std::vector<char> stacks;
  for (unsigned b = 0; b < grid; ++b) {
    memset(buf.data(), 0xFF, buf.size() * 16);
    if (!cuda_sim::run_threads(kernel, make_uint3(b, 0, 0), dim3((unsigned)threads),
                               dim3(grid), 0, threads, reinterpret_cast<char*>(buf.data()),
                               stacks))
      return -3;
  }
  return 0;
}

template <int ACT>
int run_act(const NriParams& p, int rounds, unsigned grid) {
#define NRI_SIM_CASE(D)                                                                     \
  return rounds == nri_dev::kStreamRounds ? run_grid<ACT, D, nri_dev::kStreamRounds>(p, grid) \
                                          : -1;
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

// Runs variant 3 on the CPU over a grid of `grid` blocks (min(N, grid); the device launch
// takes SMs x resident blocks). The launch-shape fields must be explicit as the binding
// fills them (warps_per_block 1, 2, 4 or 8; heads_per_warp (256 / D) x 2;
// heads_per_block their product); stages 0 means the default 3. Returns 0, -1 for an
// unsupported shape, -2 when nri_launch would run variant 1 instead (tensors misaligned
// for cp.async: nri_dev::stream_eligible), -3 if the lanes' barriers deadlocked.
int nri_stream_sim_launch(const NriParams* p, int64_t grid) {
  if (p == nullptr || p->variant != 3 || p->n < 0 || grid < 1) return -1;
  const int64_t g = 256 / (p->head_dim ? p->head_dim : 1);
  const int64_t w = p->warps_per_block, hpw = p->heads_per_warp;
  if (g < 1 || (w != 1 && w != 2 && w != 4 && w != 8) || hpw < g || hpw % g ||
      p->heads_per_block != w * hpw || p->heads_fast != 0 || p->stages == 1 ||
      p->stages < 0 || p->stages > nri_dev::kStreamMaxStages)
    return -1;
  const int rounds = (int)(hpw / g);
  if (rounds != nri_dev::kStreamRounds) return -1;
  if (p->n == 0) return 0;
  if (!nri_dev::stream_eligible(*p)) return -2;
  NriParams q = *p;
  if (q.stages == 0) q.stages = nri_dev::kStreamDefaultStages;
  const unsigned blocks = (unsigned)(q.n < grid ? q.n : grid);
  return q.act_fmt == cvt::FMT_BF16 ? run_act<cvt::FMT_BF16>(q, rounds, blocks)
                                    : run_act<cvt::FMT_F16>(q, rounds, blocks);
}
}
