// CPU stand-ins for the CUDA built-ins that csrc/nri_vec.cuh and csrc/nri_stream.cuh use,
// so that g++ compiles the kernels unchanged and the CPU tests run them
// (csrc/nri_vec_host.cpp, csrc/nri_stream_host.cpp, tests/test_csrc.py). One OS thread runs
// the lanes of a warp (variants 1, 2) or of a whole block (variant 3) as coroutines
// (ucontext): a lane runs until its next warp shuffle / __syncwarp (a warp barrier) or
// __syncthreads (the block's barrier), then the next lane; a barrier opens when every lane
// concerned has arrived, and the lanes continue. A lane that ends while others wait (lanes
// reaching different numbers of shuffles, which a full-mask shuffle forbids on the GPU), or
// lanes waiting at barriers that can never open, are reported as a deadlock. Blocks run one
// after another (blocks never synchronise with each other); dynamic shared memory is a host
// buffer per block. Float arithmetic is IEEE single precision with correctly rounded + - * /
// and fma (rsqrtf: 1 / sqrtf, two roundings, within the device's 2 ulp); fp8_convert.h's
// hardware conversions are replaced by its software paths (bit-identical to them: the GPU
// codec tests). cp.async copies (csrc/nri_stream.cuh) complete at once (memcpy): the
// simulation checks addressing and barrier placement between lanes, not the asynchrony.
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

// A lane is READY to run, waiting at its warp's barrier (a shuffle or __syncwarp), waiting
// at the block's barrier (__syncthreads), or DONE.
enum LaneState { READY = 0, AT_WARP = 1, AT_BLOCK = 2, DONE = 3 };

// The simulated threads of one run: threads first .. first + count - 1 of a block (whole
// warps), each a coroutine of the calling OS thread, and the block's dynamic shared memory.
struct Group {
  ucontext_t sched;
  std::vector<ucontext_t> ctx;
  std::vector<int> state;
  std::vector<uint32_t> slot;
  unsigned first = 0;
  char* smem = nullptr;
};

// The running lane: its indices and its group (one OS thread runs one lane at a time).
struct Thread {
  uint3 tid, bid;
  dim3 bdim, gdim;
  Group* group;
};

inline thread_local Thread self;

inline int lane_index() { return (int)(self.tid.x - self.group->first); }

// The calling lane waits until every lane of its warp (AT_WARP) or of the group (AT_BLOCK)
// has arrived at such a barrier as often.
inline void wait_at(int barrier) {
  Group& g = *self.group;
  const int i = lane_index();
  g.state[i] = barrier;
  swapcontext(&g.ctx[i], &g.sched);
}

inline void warp_barrier() { wait_at(AT_WARP); }
inline void block_barrier() { wait_at(AT_BLOCK); }

// Runs fn() as threads first .. first + count - 1 (whole warps) of block `bid` (blocks of
// bdim threads, a grid of gdim blocks) with `smem` as the block's dynamic shared memory:
// returns false if the lanes deadlocked (some lanes ended, or waited at a different kind of
// barrier, while others waited). Every round runs each ready lane to its next barrier (or
// its end), alternately in thread order and in reverse warp order (a warp that runs ahead
// of the others past a missing __syncthreads is caught either way), then opens the
// barriers every lane concerned has reached. `stacks` holds the lane stacks (reused).
template <class Fn>
bool run_threads(Fn& fn, uint3 bid, dim3 bdim, dim3 gdim, unsigned first, int count,
                 char* smem, std::vector<char>& stacks) {
  constexpr size_t kStack = 256 * 1024;
  if (count <= 0 || count % 32) return false;
  if (stacks.size() < count * kStack) stacks.resize(count * kStack);
  Group g;
  g.ctx.resize(count);
  g.state.assign(count, READY);
  g.slot.assign(count, 0);
  g.first = first;
  g.smem = smem;
  static thread_local Fn* entry_fn;
  entry_fn = &fn;
  struct Entry {
    static void run() {
      (*entry_fn)();
      self.group->state[lane_index()] = DONE;  // then uc_link: back to the scheduler
    }
  };
  for (int i = 0; i < count; ++i) {
    getcontext(&g.ctx[i]);
    g.ctx[i].uc_stack.ss_sp = stacks.data() + i * kStack;
    g.ctx[i].uc_stack.ss_size = kStack;
    g.ctx[i].uc_link = &g.sched;
    makecontext(&g.ctx[i], &Entry::run, 0);
  }
  const int warps = count / 32;
  for (int round = 0;; ++round) {
    for (int k = 0; k < count; ++k) {  // every ready lane to its next barrier (or its end)
      const int i = (round & 1) ? (warps - 1 - k / 32) * 32 + k % 32 : k;
      if (g.state[i] != READY) continue;
      self = Thread{make_uint3(first + (unsigned)i, 0, 0), bid, bdim, gdim, &g};
      swapcontext(&g.sched, &g.ctx[i]);
    }
    int done = 0, at_block = 0;
    bool opened = false;
    for (int w = 0; w < warps; ++w) {
      int at_warp = 0;
      for (int l = 0; l < 32; ++l) {
        const int st = g.state[w * 32 + l];
        at_warp += st == AT_WARP, at_block += st == AT_BLOCK, done += st == DONE;
      }
      if (at_warp == 32) {
        for (int l = 0; l < 32; ++l) g.state[w * 32 + l] = READY;
        opened = true;
      }
    }
    if (done == count) return true;
    if (at_block == count) {
      for (int i = 0; i < count; ++i) g.state[i] = READY;
      opened = true;
    }
    if (!opened) return false;  // lanes wait at barriers that can never open
  }
}

// Runs fn() as the 32 lanes of warp `warp` of block `bid` (block of bdim threads; a kernel
// that never calls __syncthreads): returns false if the lanes deadlocked.
template <class Fn>
bool run_warp(Fn& fn, uint3 bid, dim3 bdim, int warp, std::vector<char>& stacks) {
  return run_threads(fn, bid, bdim, dim3(1), (unsigned)(warp * 32), 32, nullptr, stacks);
}

// shfl.sync.idx / .bfly semantics (PTX ISA): the source lane j of lane i with width w
// (a power of two) is (i & ~(w - 1)) | (b & (w - 1)) for idx, i ^ b for bfly (kept when it
// stays inside i's segment of w lanes, else i itself).
inline uint32_t exchange(uint32_t v, int src_lane) {
  Group& g = *self.group;
  const int i = lane_index();
  g.slot[i] = v;
  warp_barrier();
  const uint32_t r = g.slot[(i & ~31) + src_lane];
  warp_barrier();
  return r;
}

// The block's dynamic shared memory (extern __shared__ on the device).
inline char* dynamic_smem() { return self.group->smem; }

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
#define gridDim (cuda_sim::self.gdim)

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
inline void __syncthreads() { cuda_sim::block_barrier(); }

inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __uint_as_float(unsigned u) { return cuda_sim::u2f(u); }
inline int min(int a, int b) { return a < b ? a : b; }
