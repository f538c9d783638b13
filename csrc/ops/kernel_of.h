#pragma once
// The kernel the dispatcher calls for an operator declared in fusedamp/ops.h: a function of the
// operator's Signature that gathers its arguments into the declaration and hands it to
// Entry::run, a backend's entry (kernel_entry.h for the dense operators, sparse_rows_args.h for
// the row-wise ones), whose result it returns.
namespace fusedamp::kernels {

template <typename Op, typename Signature = typename Op::Signature>
struct KernelOf;
template <typename Op, typename Result, typename... Args>
struct KernelOf<Op, Result(Args...)> {
  template <typename Entry>
  static Result kernel(Args... args) {
    return Entry::run(Op{args...});
  }
};

}  // namespace fusedamp::kernels
