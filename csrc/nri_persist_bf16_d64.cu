// Variant 4 of the fused insert for bf16 activations and D = 64: persistent warps over
// (token, head chunk) items (csrc/nri_persist.cuh); variant 5's fallback when R != D / 2.
#include "nri_persist.cuh"

NRI_PERSIST_ENTRY(nri_launch_persist_bf16_d64) {
  return nri_dev::launch_persist<cvt::FMT_BF16, 64, false>(p, rounds, s);
}
