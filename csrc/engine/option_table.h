#pragma once
// A kind's options as rows: those every kind carries (shared_options.h), then its algorithm's
// own (AlgorithmOf<Options>::kOptions). A row holds the name a param group, set_group_option
// and an archive give the option, its form (options.h OptionForm: what its number stands for,
// how archives keep it), how the options struct reads and writes it as that number, and
// whether archives written before it existed may lack it (the default options' value is then
// taken). set_group_option, group_option, the archive's write and read and the values
// fusedamp.optim's constructors are held to are these functions over the rows, written once.
#include <c10/util/Exception.h>
#include <fusedamp/optim/options.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "option_checks.h"

namespace fusedamp::optim::detail {

template <typename Options>
struct OptionRow {
  const char* name;
  OptionForm form;
  double (*get)(const Options&);
  // A flag's number is checked before set is called (flag_option); other forms check in set.
  void (*set)(Options&, double);
  bool optional_in_archives = false;
  // kNumberOrNone: whether the options hold a number (get reads none as 0), and none.
  bool (*held)(const Options&) = nullptr;
  void (*clear)(Options&) = nullptr;
};

// The row of a number or flag field of Options (a TORCH_ARG of type double or bool), under the
// field's name; optional_in_archives may follow the form.
#define FUSEDAMP_OPTION_ROW(Options, field, form, ...)                                      \
  ::fusedamp::optim::detail::OptionRow<Options> {                                          \
    #field, form, [](const Options& o) { return static_cast<double>(o.field()); },         \
        [](Options& o, double v) { o.field(static_cast<std::decay_t<decltype(o.field())>>(v)); }, \
        __VA_ARGS__                                                                         \
  }

// The rows of a betas tuple's entries (Adam's, Lion's), as param groups and archives name them:
// beta1 (k = 0) and beta2 (k = 1).
template <typename Options, size_t k>
constexpr OptionRow<Options> beta_row() {
  return {k == 0 ? "beta1" : "beta2", OptionForm::kNumber,
          [](const Options& o) { return std::get<k>(o.betas()); },
          [](Options& o, double v) {
            auto betas = o.betas();
            std::get<k>(betas) = v;
            o.betas(betas);
          }};
}

template <typename Options, size_t N>
bool set_table_option(const OptionRow<Options> (&rows)[N], Options& o, const std::string& name,
                      double value) {
  for (const auto& row : rows) {
    if (name == row.name) {
      row.set(o, row.form == OptionForm::kFlag ? static_cast<double>(flag_option(name, value))
                                               : value);
      return true;
    }
  }
  return false;
}

template <typename Options, size_t N>
std::optional<double> table_option(const OptionRow<Options> (&rows)[N], const Options& o,
                                   const std::string& name) {
  for (const auto& row : rows) {
    if (name == row.name) {
      return row.get(o);
    }
  }
  return std::nullopt;
}

// Sets an option that may be none (kNumberOrNone) to none; false for a name not in the rows.
template <typename Options, size_t N>
bool clear_table_option(const OptionRow<Options> (&rows)[N], Options& o, const std::string& name) {
  for (const auto& row : rows) {
    if (name == row.name) {
      TORCH_CHECK(row.form == OptionForm::kNumberOrNone, "fusedamp::optim: option '", name,
                  "' cannot be none");
      row.clear(o);
      return true;
    }
  }
  return false;
}

template <typename Options, size_t N>
void append_table_values(const OptionRow<Options> (&rows)[N], const Options& o,
                         std::vector<OptionValue>& out) {
  for (const auto& row : rows) {
    const bool none = row.form == OptionForm::kNumberOrNone && !row.held(o);
    out.push_back({row.name, row.form, none ? std::nullopt : std::optional<double>(row.get(o))});
  }
}

template <typename Options, size_t N>
void write_table_options(const OptionRow<Options> (&rows)[N], const Options& o,
                         torch::serialize::OutputArchive& a) {
  for (const auto& row : rows) {
    switch (row.form) {
      case OptionForm::kFlag:
        a.write(row.name, c10::IValue(row.get(o) != 0.0));
        break;
      case OptionForm::kInteger:
      case OptionForm::kMasterWeights:
      case OptionForm::kDtype:
        a.write(row.name, c10::IValue(static_cast<int64_t>(row.get(o))));
        break;
      case OptionForm::kNumberOrNone:
        if (row.held(o)) {
          a.write(row.name, c10::IValue(row.get(o)));
        }
        break;
      case OptionForm::kNumber:
        a.write(row.name, c10::IValue(row.get(o)));
        break;
    }
  }
}

template <typename Options>
double archived_number(const OptionRow<Options>& row, const c10::IValue& v) {
  switch (row.form) {
    case OptionForm::kFlag:
      return v.toBool() ? 1.0 : 0.0;
    case OptionForm::kMasterWeights:
      if (v.isBool()) {  // archives before the modes: False/True, the codes of kOff/kFp32
        return v.toBool() ? 1.0 : 0.0;
      }
      return static_cast<double>(v.toInt());
    case OptionForm::kInteger:
    case OptionForm::kDtype:
      return static_cast<double>(v.toInt());
    case OptionForm::kNumber:
    case OptionForm::kNumberOrNone:
      break;
  }
  return v.toDouble();
}

template <typename Options, size_t N>
void read_table_options(const OptionRow<Options> (&rows)[N], Options& o,
                        torch::serialize::InputArchive& a) {
  c10::IValue v;
  for (const auto& row : rows) {
    if (!row.optional_in_archives) {
      a.read(row.name, v);
    } else if (!a.try_read(row.name, v)) {
      if (row.form == OptionForm::kNumberOrNone && !row.held(Options())) {
        row.clear(o);
      } else {
        row.set(o, row.get(Options()));
      }
      continue;
    }
    row.set(o, archived_number(row, v));
  }
}

}  // namespace fusedamp::optim::detail
