// CPU stand-ins for the CUDA built-ins that csrc/nri_vec.cuh uses, so that g++ compiles the
// vectorised kernels unchanged and the CPU tests run them (csrc/nri_vec_host.cpp,
// tests/test_csrc.py). One OS thread runs a warp's 32 lanes as coroutines (ucontext):
// a lane runs until its next warp shuffle or __syncwarp, then the next lane; when all 32
// have arrived the barrier opens and the lanes continue in order. A lane that ends while
// others wait (lanes reaching different numbers of shuffles, which a full-mask shuffle
// forbids on the GPU) is reported as a deadlock. Warps and blocks run one after another
// (the kernels never synchronise across warps). Float arithmetic is IEEE single precision
// with correctly rounded + - * / and fma (rsqrtf: 1 / sqrtf, two roundings, within the
// device's 2 ulp); fp8_convert.h's hardware conversions are replaced by its software
// paths (bit-identical to them: the GPU codec tests).
#pragma once

#ifdef __CUDACC__
#error "cuda_sim.h is for host compilers (g++); nvcc has the real built-ins"
#endif

#include <cuda_runtime.h>  // uint2, uint3, uint4, dim3, make_uint*, __device__ (empty)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace cuda_sim {

enum LaneState { READY = 0, WAITING = 1, DONE = 2 };

struct Warp {
  ucontext_t sched;
  ucontext_t ctx[32];
  int state[32];
  uint32_t slot[32];
};

// The running lane: its indices and its warp (one OS thread runs one lane at a time).
struct Thread {
  uint3 tid, bid;
  dim3 bdim;
  Warp* warp;
};

inline thread_local Thread self;

// The calling lane waits until every lane of its warp has called this as often.
inline void warp_barrier() {
  Warp& w = *self.warp;
  const int lane = (int)(self.tid.x & 31);
  w.state[lane] = WAITING;
  swapcontext(&w.ctx[lane], &w.sched);
}

// Runs fn() as the 32 lanes of warp `warp` of block `bid` (block of bdim threads): returns
// false if the lanes deadlocked. `stacks` holds 32 lane stacks (reused across calls).
template <class Fn>
bool run_warp(Fn& fn, uint3 bid, dim3 bdim, int warp, std::vector<char>& stacks) {
  constexpr size_t kStack = 256 * 1024;
  stacks.resize(32 * kStack);
  Warp w;
  static thread_local Fn* entry_fn;
  entry_fn = &fn;
  struct Entry {
    static void run() {
      (*entry_fn)();
      self.warp->state[self.tid.x & 31] = DONE;  // then uc_link: back to the scheduler
    }
  };
  for (int l = 0; l < 32; ++l) {
    w.state[l] = READY;
    getcontext(&w.ctx[l]);
    w.ctx[l].uc_stack.ss_sp = stacks.data() + l * kStack;
    w.ctx[l].uc_stack.ss_size = kStack;
    w.ctx[l].uc_link = &w.sched;
    makecontext(&w.ctx[l], &Entry::run, 0);
  }
  for (;;) {
    for (int l = 0; l < 32; ++l) {  // every lane to its next barrier (or its end)
      if (w.state[l] == DONE) continue;
      w.state[l] = READY;
      self = Thread{make_uint3((unsigned)(warp * 32 + l), 0, 0), bid, bdim, &w};
      swapcontext(&w.sched, &w.ctx[l]);
    }
    int done = 0;
    for (int l = 0; l < 32; ++l) done += w.state[l] == DONE;
    if (done == 32) return true;
    if (done) return false;  // some lanes ended while others wait at a barrier
  }
}

// shfl.sync.idx / .bfly semantics (PTX ISA): the source lane j of lane i with width w
// (a power of two) is (i & ~(w - 1)) | (b & (w - 1)) for idx, i ^ b for bfly (kept when it
// stays inside i's segment of w lanes, else i itself).
inline uint32_t exchange(uint32_t v, int src_lane) {
  Warp& w = *self.warp;
  w.slot[self.tid.x & 31] = v;
  warp_barrier();
  const uint32_t r = w.slot[src_lane];
  warp_barrier();
  return r;
}

inline uint32_t f2u(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

inline float u2f(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

}  // namespace cuda_sim

#define threadIdx (cuda_sim::self.tid)
#define blockIdx (cuda_sim::self.bid)
#define blockDim (cuda_sim::self.bdim)

inline float __shfl_sync(unsigned, float v, int src, int width = 32) {
  const int lane = (int)(cuda_sim::self.tid.x & 31);
  const int j = (lane & ~(width - 1)) | (src & (width - 1));
  return cuda_sim::u2f(cuda_sim::exchange(cuda_sim::f2u(v), j));
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = 32) {
  const int lane = (int)(cuda_sim::self.tid.x & 31);
  int j = lane ^ lane_mask;
  if ((j & ~(width - 1)) != (lane & ~(width - 1))) j = lane;
  return cuda_sim::u2f(cuda_sim::exchange(cuda_sim::f2u(v), j));
}

inline void __syncwarp(unsigned = 0xFFFFFFFFu) { cuda_sim::warp_barrier(); }

inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __uint_as_float(unsigned u) { return cuda_sim::u2f(u); }
inline int min(int a, int b) { return a < b ? a : b; }
