#pragma once
// The three floating types fusedamp's kernels handle (FP32, FP16, BF16); FP64 is rejected by
// the argument checks, so it is not instantiated. Used by the CPU and the CUDA kernels.
#include <ATen/Dispatch.h>

#define FUSEDAMP_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
