// The loan of a caller's kept step rows to one op call (step_addresses.h).
#include "step_addresses.h"

namespace fusedamp {
namespace {

// What the loan was made for: the lists' vectors, by address and length.
struct Loan {
  StepAddresses* rows = nullptr;
  const at::Tensor* params = nullptr;
  const at::Tensor* master_params = nullptr;
  const at::Tensor* steps = nullptr;
  size_t count = 0;
};

thread_local Loan current_loan;

}  // namespace

StepRowsLoan::StepRowsLoan(StepAddresses& rows, at::TensorList params,
                           at::TensorList master_params, at::TensorList steps) {
  rows.kept = true;
  current_loan = Loan{&rows, params.data(), master_params.data(), steps.data(), params.size()};
}

StepRowsLoan::~StepRowsLoan() { current_loan = Loan(); }

StepAddresses* borrow_step_rows(at::TensorList params, at::TensorList master_params,
                                at::TensorList steps) {
  Loan& loan = current_loan;
  if (loan.rows == nullptr || params.empty() || loan.params != params.data() ||
      loan.count != params.size() || loan.master_params != master_params.data() ||
      loan.steps != steps.data()) {
    return nullptr;
  }
  StepAddresses* rows = loan.rows;
  loan = Loan();
  return rows;
}

}  // namespace fusedamp
