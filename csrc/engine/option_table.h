#pragma once
// An algorithm's own options (beyond those every optimizer kind carries: optimizer_of_impl.h,
// options_io.h), one row each in its AlgorithmOf<Options>::kOptions: the name a param group,
// set_group_option and an archive give it, whether it is a flag (True/False; an archive holds
// a bool) or a number, how the options struct reads and writes it, and whether archives
// written before it existed may lack it (the default options' value is then taken).
// set_group_option, group_option and the archive's write and read are these functions over
// the rows, written once.
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>

#include "option_checks.h"

namespace fusedamp::optim::detail {

template <typename Options>
struct OptionRow {
  const char* name;
  bool flag;
  double (*get)(const Options&);
  void (*set)(Options&, double);
  bool optional_in_archives = false;
};

// The rows of a betas tuple's entries (Adam's, Lion's), as param groups and archives name them:
// beta1 (k = 0) and beta2 (k = 1).
template <typename Options, size_t k>
constexpr OptionRow<Options> beta_row() {
  return {k == 0 ? "beta1" : "beta2", false,
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
      row.set(o, row.flag ? static_cast<double>(flag_option(name, value)) : value);
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

template <typename Options, size_t N>
void write_table_options(const OptionRow<Options> (&rows)[N], const Options& o,
                         torch::serialize::OutputArchive& a) {
  for (const auto& row : rows) {
    a.write(row.name, row.flag ? c10::IValue(row.get(o) != 0.0) : c10::IValue(row.get(o)));
  }
}

template <typename Options, size_t N>
void read_table_options(const OptionRow<Options> (&rows)[N], Options& o,
                        torch::serialize::InputArchive& a) {
  c10::IValue v;
  for (const auto& row : rows) {
    if (!row.optional_in_archives) {
      a.read(row.name, v);
    } else if (!a.try_read(row.name, v)) {
      row.set(o, row.get(Options()));
      continue;
    }
    row.set(o, row.flag ? static_cast<double>(v.toBool()) : v.toDouble());
  }
}

}  // namespace fusedamp::optim::detail
