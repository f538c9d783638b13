#pragma once
// The typed dispatcher handle of an operator, by its declaration (fusedamp/ops.h): what
// everything that calls an operator unboxed goes through (the C++ API in ops.cpp, the Autograd
// kernels, the Python entry fusedamp.ops).
#include <ATen/core/dispatch/Dispatcher.h>
#include <fusedamp/ops.h>

namespace fusedamp::ops {

// Op's handle, looked up once per library that calls it (at the first call, once the schemas
// are registered).
template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(Op::kName, "")
                             .template typed<typename Op::Signature>();
  return op;
}

// Op's arguments to f(handle, argument...), in schema order.
template <typename Op, typename F>
decltype(auto) with_arguments(const Op& args, F&& f) {
  return args.apply(
      [&](detail::Lead, const auto&... a) -> decltype(auto) { return f(handle<Op>(), a...); });
}

// The dispatcher's call of Op: what the operator returns.
template <typename Op>
decltype(auto) call(const Op& args) {
  return with_arguments(args, [](const auto& op, const auto&... a) -> decltype(auto) {
    return op.call(a...);
  });
}

}  // namespace fusedamp::ops
