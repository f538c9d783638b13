// The optimizers' hyper-parameter checks (see option_checks.h).
#include "option_checks.h"

#include <c10/util/Exception.h>

#include "../ops/hyper_params.h"

namespace fusedamp::optim::detail {

bool flag_option(const std::string& name, double value) {
  TORCH_CHECK_VALUE(value == 0.0 || value == 1.0, "fusedamp: '", name,
                    "' is a flag: True or False, got ", value);
  return value != 0.0;
}

at::ScalarType state_dtype_option(double value) {
  for (const auto t : {at::kFloat, at::kBFloat16, at::kChar}) {
    if (value == static_cast<double>(t)) {
      return t;
    }
  }
  TORCH_CHECK_VALUE(false, "fusedamp: state_dtype must be torch.float32, torch.bfloat16 or "
                    "torch.int8 (as a number: the ScalarType code ", static_cast<int>(at::kFloat),
                    ", ", static_cast<int>(at::kBFloat16), " or ", static_cast<int>(at::kChar),
                    "), got ", value);
}

int64_t seed_option(const std::string& name, double value) {
  constexpr double kMaxExact = 9007199254740992.0;  // 2^53: every integer below is a double
  TORCH_CHECK_VALUE(value >= 0.0 && value <= kMaxExact && value == static_cast<double>(
                        static_cast<int64_t>(value)),
                    "fusedamp: '", name, "' must be a whole number in [0, 2^53], got ", value);
  return static_cast<int64_t>(value);
}
namespace {

// " (fusedamp::optim::Adam, param group 1)": where the bad value is.
struct Where {
  const char* who;
  size_t group;
};
std::ostream& operator<<(std::ostream& out, const Where& w) {
  return out << " (fusedamp::optim::" << w.who << ", param group " << w.group << ")";
}

}  // namespace

void check_common_options(const char* who, double lr, double weight_decay,
                          const EngineGroupOptions& e, size_t group) {
  const Where where{who, group};
  TORCH_CHECK_VALUE(hyper::valid_lr(lr), "Invalid learning rate: ", lr, where);
  TORCH_CHECK_VALUE(hyper::valid_weight_decay(weight_decay), "Invalid weight_decay value: ",
                    weight_decay, where);
  // A kernel variant (fusedamp/master_modes.h) is no value of the option: an archive could not
  // name it.
  TORCH_CHECK_VALUE(e.master_weights.info().spelling != nullptr, "Invalid master_weights: ",
                    e.master_weights.name(), " (", MasterWeights::choices(), ")", where);
  if (e.max_grad_norm) {
    TORCH_CHECK_VALUE(hyper::valid_max_grad_norm(*e.max_grad_norm), "Invalid max_grad_norm: ",
                      *e.max_grad_norm, " (must be finite and > 0, or None)", where);
  }
  TORCH_CHECK_VALUE(e.state_dtype == at::kFloat || e.state_dtype == at::kBFloat16 ||
                        e.state_dtype == at::kChar,
                    "Invalid state_dtype: ", e.state_dtype, " (float32, bfloat16 or int8)",
                    where);
  TORCH_CHECK_VALUE(e.rounding_seed >= 0, "Invalid rounding_seed: ", e.rounding_seed,
                    " (must be >= 0)", where);
  if (e.lr_tensor.defined()) {
    const auto& t = e.lr_tensor;
    TORCH_CHECK_VALUE(
        t.layout() == at::kStrided && t.numel() == 1 && t.scalar_type() == at::kFloat,
        "Invalid lr_tensor: a tensor learning rate must be a dense float32 tensor with one "
        "element, got ",
        t.scalar_type(), " with ", t.numel(), " elements", where);
  }
}

namespace {

void check_betas(const Where& where, double beta1, double beta2) {
  TORCH_CHECK_VALUE(hyper::valid_beta(beta1), "Invalid beta parameter at index 0: ", beta1,
                    where);
  TORCH_CHECK_VALUE(hyper::valid_beta(beta2), "Invalid beta parameter at index 1: ", beta2,
                    where);
}

}  // namespace

void check_adam_options(const char* who, double beta1, double beta2, double eps, bool amsgrad,
                        at::ScalarType state_dtype, size_t group) {
  const Where where{who, group};
  TORCH_CHECK_VALUE(!(amsgrad && state_dtype == at::kChar),
                    "Invalid state_dtype: int8 moments do not keep AMSGrad's running maximum "
                    "of exp_avg_sq (amsgrad=True needs float32 or bfloat16 state)", where);
  check_betas(where, beta1, beta2);
  TORCH_CHECK_VALUE(hyper::valid_eps(eps), "Invalid epsilon value: ", eps, where);
}

void check_lion_options(const char* who, double beta1, double beta2, at::ScalarType state_dtype,
                        size_t group) {
  const Where where{who, group};
  TORCH_CHECK_VALUE(state_dtype != at::kChar,
                    "Invalid state_dtype: Lion's exp_avg has no 8-bit format (state_dtype "
                    "int8 is for Adam/AdamW and SGD; Lion takes float32 or bfloat16)", where);
  check_betas(where, beta1, beta2);
}

void check_sgd_options(const char* who, double momentum, double dampening, bool nesterov,
                       size_t group) {
  const Where where{who, group};
  TORCH_CHECK_VALUE(hyper::valid_momentum(momentum), "Invalid momentum value: ", momentum,
                    where);
  TORCH_CHECK_VALUE(hyper::valid_dampening(dampening), "Invalid dampening value: ", dampening,
                    where);
  TORCH_CHECK_VALUE(hyper::valid_nesterov(nesterov, momentum, dampening),
                    "Nesterov momentum requires a momentum and zero dampening", where);
}

}  // namespace fusedamp::optim::detail
