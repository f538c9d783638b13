#pragma once
// The optimizers' validation of their hyper-parameters: the ranges of ../hyper_params.h with
// torch.optim's wording (its users read these), raised as c10::ValueError (ValueError in
// Python, as torch.optim raises) and naming the optimizer and the param group.
#include <cstddef>

namespace fusedamp::optim::detail {

void check_adam_options(const char* who, double beta1, double beta2, double eps, size_t group);
void check_sgd_options(const char* who, double momentum, double dampening, bool nesterov,
                       size_t group);

}  // namespace fusedamp::optim::detail
