#pragma once
// The optimizers' validation of their hyper-parameters: the ranges of ../hyper_params.h with
// torch.optim's wording (its users read these), raised as c10::ValueError (ValueError in
// Python, as torch.optim raises) and naming the optimizer and the param group.
#include <fusedamp/optim/optimizer.h>

#include <cstddef>
#include <string>

namespace fusedamp::optim::detail {

// A yes/no option given as a number (param-group dicts pass True/False as 1/0): 0 or 1, nothing
// else. master_weights=2 or 0.5 would otherwise silently mean True; for master_weights the
// message names the modes that exist.
bool flag_option(const std::string& name, double value);

// lr, weight_decay and the engine fields, which every optimizer kind carries.
void check_common_options(const char* who, double lr, double weight_decay,
                          const EngineGroupOptions& e, size_t group);

void check_adam_options(const char* who, double beta1, double beta2, double eps, size_t group);
void check_sgd_options(const char* who, double momentum, double dampening, bool nesterov,
                       size_t group);

}  // namespace fusedamp::optim::detail
