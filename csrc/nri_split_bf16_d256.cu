// Variant 5 of the fused insert for bf16 activations and D = 256: variant 4's persistent
// grid with the split lanes (csrc/nri_persist.cuh, csrc/nri_split.cuh), for R = D / 2.
#include "nri_persist.cuh"

NRI_PERSIST_ENTRY(nri_launch_split_bf16_d256) {
  return nri_dev::launch_persist<cvt::FMT_BF16, 256, true>(p, rounds, s);
}
