#pragma once
// The optimizers' validation of their hyper-parameters: the ranges of ../ops/hyper_params.h with
// torch.optim's wording (its users read these), raised as c10::ValueError (ValueError in
// Python, as torch.optim raises) and naming the optimizer and the param group.
#include <fusedamp/optim/options.h>

#include <cstddef>
#include <string>

namespace fusedamp::optim::detail {

// A yes/no option given as a number (param-group dicts pass True/False as 1/0): 0 or 1, nothing
// else (2 or 0.5 would otherwise silently mean True).
bool flag_option(const std::string& name, double value);

// state_dtype given as a number: the c10::ScalarType code of float32 or bfloat16.
at::ScalarType state_dtype_option(double value);
// An integer option given as a number (rounding_seed): a whole number in [0, 2^53].
int64_t seed_option(const std::string& name, double value);

// lr, weight_decay and the engine fields, which every optimizer kind carries.
void check_common_options(const char* who, double lr, double weight_decay,
                          const EngineGroupOptions& e, size_t group);

// amsgrad with int8 state (quantized moments keep no running maximum) is refused.
void check_adam_options(const char* who, double beta1, double beta2, double eps, bool amsgrad,
                        at::ScalarType state_dtype, size_t group);
// int8 state is refused (Lion's exp_avg has no 8-bit format).
void check_lion_options(const char* who, double beta1, double beta2, at::ScalarType state_dtype,
                        size_t group);
void check_sgd_options(const char* who, double momentum, double dampening, bool nesterov,
                       size_t group);

}  // namespace fusedamp::optim::detail
