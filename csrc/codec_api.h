// extern "C" array-wise entry points of the conversions in fp8_convert.h, for the tests:
// codec_host.cpp builds them for the CPU (g++, tests/test_csrc.py checks them exhaustively
// against reference/codec.py); test_support.cu runs the same conversions on the GPU.
// Formats are the cvt::FMT_* codes (0 e4m3fn, 1 e5m2, 2 e4m3fnuz, 3 e5m2fnuz, 4 bf16, 5 fp16).
#pragma once

#include <stdint.h>

extern "C" {

// Host (CPU) versions.
// fp32 -> fp8 codes (satfinite != 0: satfinite, else nonsaturating).
void cvt_encode_fp8(const float* x, uint8_t* out, int64_t n, int fmt, int satfinite);
// fp8 codes -> fp32 values.
void cvt_decode_fp8(const uint8_t* c, float* out, int64_t n, int fmt);
// fp32 -> bf16 / fp16 bits, RNE (fmt 4 or 5).
void cvt_round_half(const float* x, uint16_t* out, int64_t n, int fmt);
// bf16 / fp16 bits -> fp32 values.
void cvt_decode_half(const uint16_t* c, float* out, int64_t n, int fmt);

// GPU versions (device pointers, on `stream`; returns the cudaError_t as int). op: 0 encode
// fp8 (the kernels' path: native satfinite cvt for e4m3fn/e5m2 when satfinite), 1 encode fp8
// with the software path only, 2 decode fp8, 3 round to bf16/fp16, 4 decode bf16/fp16.
int cvt_device(int op, const void* in, void* out, int64_t n, int fmt, int satfinite,
               void* stream);
// A launch with an invalid configuration (too many threads per block): returns
// cudaErrorInvalidConfiguration as int without touching any memory, for the error-path test.
int csrc_test_bad_launch(void* stream);
}
