#pragma once
// How an operator's arguments are declared in C++ (fusedamp/ops.h uses this).
//
// An operator's schema (csrc/schemas.cpp) is the one source of its arguments' names, order and
// defaults. Its C++ declaration is one list of the same arguments, in the same order, each with
// its kind (the schema type); FUSEDAMP_DECLARE_OP turns that list into
//   - a struct with one field per argument: what every consumer of the operator takes (its
//     checks, the CPU, CUDA and Meta kernels, the Autograd kernels, the Python entry, the
//     engine and C++ users). A field left out of an initialisation takes the schema's default
//     (read from the schema once); a float argument without a default starts as NaN, which
//     the checks refuse, so that a forgotten learning rate is an error, not a zero;
//   - Signature, the C++ function type the dispatcher knows the operator by;
//   - apply(f), the arguments as f's in schema order, and for_each_field(f), each argument
//     with its position.
// Arguments that several operators take at the same place in their schemas are declared once
// as a group (FUSEDAMP_DECLARE_ARG_GROUP): a struct of their fields, listed as one argument of
// its own kind. Each operator then holds the group as one field, which a caller fills once and
// every consumer takes whole; to the dispatcher (Signature, apply, for_each_field, aggregate
// initialisation in schema order) its fields are the operator's, in their places.
// The kernels' registration checks the field types against the schema (torch infers a
// schema from each kernel's signature); tests/cpp checks the names and order.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/OptionalArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

namespace fusedamp::ops {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// The C++ type of each schema type an operator uses.
namespace kind {
using Tensors = at::TensorList;                    // Tensor[]
using OptTensors = std::optional<at::TensorList>;  // Tensor[]?
using Tensor = at::Tensor;                         // Tensor
using OptTensor = std::optional<at::Tensor>;       // Tensor?
using Float = double;                              // float
using OptFloat = std::optional<double>;            // float?
using Int = int64_t;                               // int
using OptInt = std::optional<int64_t>;             // int?
using Bool = bool;                                 // bool
using OptInts = c10::OptionalIntArrayRef;          // int[]?
}  // namespace kind

namespace detail {

// The schema's default value of argument `arg` of operator `op` (qualified name), as a double,
// int64 or bool; nullopt where it has none or it is None. Throws where `op` or `arg` is not
// registered.
std::optional<double> schema_default_number(const char* op, const char* arg);

// A field's initial value: the schema's default for numbers and flags; empty otherwise (the
// schema's only default for a tensor, list or optional is None).
template <typename T>
T initial_value(const char* op, const char* arg) {
  if constexpr (std::is_same_v<T, double>) {
    return schema_default_number(op, arg).value_or(std::numeric_limits<double>::quiet_NaN());
  } else if constexpr (std::is_same_v<T, std::optional<double>> || std::is_same_v<T, int64_t> ||
                       std::is_same_v<T, bool>) {
    const auto v = schema_default_number(op, arg);
    if constexpr (std::is_same_v<T, std::optional<double>>) {
      return v;
    } else {
      return static_cast<T>(v.value_or(0.0));
    }
  } else {
    return T();
  }
}

// How a field is passed to the dispatcher: tensors by const reference, the rest by value.
template <typename T>
struct Param {
  using type = T;
};
template <>
struct Param<at::Tensor> {
  using type = const at::Tensor&;
};
template <>
struct Param<std::optional<at::Tensor>> {
  using type = const std::optional<at::Tensor>&;
};

// Opens the comma-led lists the declaration macro writes; dropped again below.
struct Lead {};

template <typename... T>
struct TypeList {};
template <typename F>
struct ListOf;
template <typename... A>
struct ListOf<void(Lead, A...)> {
  using type = TypeList<A...>;
};

// Whether T is an argument group (FUSEDAMP_DECLARE_ARG_GROUP), and what it stands for: its
// fields' dispatcher types, their number, the fields themselves.
template <typename T, typename = void>
struct IsGroup : std::false_type {};
template <typename T>
struct IsGroup<T, std::void_t<typename T::Params>> : std::true_type {};

template <typename T>
constexpr size_t field_count() {
  if constexpr (IsGroup<T>::value) {
    return T::kArgCount;
  } else {
    return 1;
  }
}

template <typename T>
auto params_of() {
  if constexpr (IsGroup<T>::value) {
    return typename T::Params{};
  } else {
    return TypeList<T>{};
  }
}

template <typename... A, typename... B>
TypeList<A..., B...> operator+(TypeList<A...>, TypeList<B...>);

template <typename Result, typename L>
struct FunctionOf;
template <typename Result, typename... A>
struct FunctionOf<Result, TypeList<A...>> {
  using type = Result(A...);
};

// The dispatcher's function type, returning Result, of a comma-led parameter list: groups
// spread into their fields' types.
template <typename Result, typename F>
struct DropLead;
template <typename Result, typename... A>
struct DropLead<Result, void(Lead, A...)> {
  using type =
      typename FunctionOf<Result, decltype((TypeList<>{} + ... + params_of<A>()))>::type;
};

template <typename... A>
std::tuple<const A&...> tie_fields(Lead, const A&... a) {
  return std::tuple<const A&...>(a...);
}

template <typename T>
auto spread(const T& value) {
  if constexpr (IsGroup<T>::value) {
    return value.fields();
  } else {
    return std::tuple<const T&>(value);
  }
}

// f(Lead, argument...): the fields given, each group's in its place.
template <typename F, typename... A>
decltype(auto) apply_spread(F&& f, Lead, const A&... a) {
  return std::apply(std::forward<F>(f), std::tuple_cat(std::tuple<Lead>(), spread(a)...));
}

// f(field, position, name) for a field, or for each of a group's.
template <typename F, typename T>
void visit_field(F& f, T& field, size_t& i, const char* name) {
  if constexpr (IsGroup<std::remove_const_t<T>>::value) {
    field.for_each_field(f, i);
  } else {
    f(field, i++, name);
  }
}

}  // namespace detail
}  // namespace fusedamp::ops

// One field of a declaration: its kind's type, initialised from the schema once per program.
#define FUSEDAMP_OP_FIELD(K, name)                                                         \
  ::fusedamp::ops::kind::K name = [] {                                                     \
    static const auto v =                                                                  \
        ::fusedamp::ops::detail::initial_value<::fusedamp::ops::kind::K>(kName, #name);    \
    return v;                                                                              \
  }();
#define FUSEDAMP_OP_PARAM(K, name) \
  , typename ::fusedamp::ops::detail::Param<::fusedamp::ops::kind::K>::type
#define FUSEDAMP_OP_VALUE(K, name) , name
#define FUSEDAMP_OP_VISIT(K, name) ::fusedamp::ops::detail::visit_field(f, name, i, #name);
#define FUSEDAMP_OP_COUNT(K, name) \
  +::fusedamp::ops::detail::field_count<::fusedamp::ops::kind::K>()

// struct Op for the operator fusedamp::<op> with the arguments ARGS(X) lists as X(kind, name).
#define FUSEDAMP_DECLARE_OP(Op, op, ARGS) FUSEDAMP_DECLARE_OP_RETURNING(Op, op, void, ARGS)

// The same for an operator that returns Result (a type's name: its outputs, as the schema's).
#define FUSEDAMP_DECLARE_OP_RETURNING(Op, op, Result, ARGS)                                  \
  struct Op {                                                                                \
    static constexpr const char* kName = "fusedamp::" #op;                                   \
    static constexpr const char* kShortName = #op;                                           \
    static constexpr size_t kArgCount = 0 ARGS(FUSEDAMP_OP_COUNT);                            \
    using Signature = typename ::fusedamp::ops::detail::DropLead<Result, void(              \
        ::fusedamp::ops::detail::Lead ARGS(FUSEDAMP_OP_PARAM))>::type;                       \
    ARGS(FUSEDAMP_OP_FIELD)                                                                  \
    template <typename F>                                                                    \
    decltype(auto) apply(F&& f) const {                                                      \
      return ::fusedamp::ops::detail::apply_spread(                                          \
          f, ::fusedamp::ops::detail::Lead{} ARGS(FUSEDAMP_OP_VALUE));                       \
    }                                                                                        \
    template <typename F>                                                                    \
    void for_each_field(F&& f) const {                                                       \
      size_t i = 0;                                                                          \
      ARGS(FUSEDAMP_OP_VISIT)                                                                \
    }                                                                                        \
    template <typename F>                                                                    \
    void for_each_field(F&& f) {                                                             \
      size_t i = 0;                                                                          \
      ARGS(FUSEDAMP_OP_VISIT)                                                                \
    }                                                                                        \
  }

// The argument group Group, ARGS(X) listing its arguments as X(kind, name), placed in an
// operator's list as X(Group, member). Its fields start at the schema defaults of operator `op`
// (each operator taking the group must give its arguments the same ones: tests/cpp checks).
#define FUSEDAMP_DECLARE_ARG_GROUP(Group, op, ARGS)                                           \
  struct Group {                                                                             \
    static constexpr const char* kName = "fusedamp::" #op;                                   \
    static constexpr size_t kArgCount = 0 ARGS(FUSEDAMP_OP_COUNT);                            \
    using Params = typename ::fusedamp::ops::detail::ListOf<void(                           \
        ::fusedamp::ops::detail::Lead ARGS(FUSEDAMP_OP_PARAM))>::type;                       \
    ARGS(FUSEDAMP_OP_FIELD)                                                                  \
    auto fields() const {                                                                    \
      return ::fusedamp::ops::detail::tie_fields(                                            \
          ::fusedamp::ops::detail::Lead{} ARGS(FUSEDAMP_OP_VALUE));                          \
    }                                                                                        \
    template <typename F>                                                                    \
    void for_each_field(F&& f, size_t& i) const {                                            \
      ARGS(FUSEDAMP_OP_VISIT)                                                                \
    }                                                                                        \
    template <typename F>                                                                    \
    void for_each_field(F&& f, size_t& i) {                                                  \
      ARGS(FUSEDAMP_OP_VISIT)                                                                \
    }                                                                                        \
  };                                                                                         \
  namespace kind {                                                                           \
  using Group = ::fusedamp::ops::Group;                                                      \
  }
