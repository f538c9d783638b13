#pragma once
// The options every fusedamp optimizer kind carries (lr, weight_decay, maximize and the engine
// fields of FUSEDAMP_ENGINE_OPTION_FIELDS) as rows of option_table.h, in the order archives
// hold them; an algorithm's own rows (AlgorithmOf<Options>::kOptions) follow them.
#include <fusedamp/optim/options.h>

#include <optional>

#include "option_checks.h"
#include "option_table.h"

namespace fusedamp::optim::detail {

template <typename Options>
struct SharedOptions {
  // Rows with optional_in_archives are absent from archives written before they existed.
  static constexpr OptionRow<Options> kRows[] = {
      FUSEDAMP_OPTION_ROW(Options, lr, OptionForm::kNumber),
      FUSEDAMP_OPTION_ROW(Options, weight_decay, OptionForm::kNumber),
      FUSEDAMP_OPTION_ROW(Options, maximize, OptionForm::kFlag),
      {"master_weights", OptionForm::kMasterWeights,
       [](const Options& o) { return static_cast<double>(o.master_weights().kind()); },
       [](Options& o, double v) { o.master_weights(MasterWeights::from_code(v)); }},
      {"state_dtype", OptionForm::kDtype,
       [](const Options& o) { return static_cast<double>(o.state_dtype()); },
       [](Options& o, double v) { o.state_dtype(state_dtype_option(v)); },
       /*optional_in_archives=*/true},
      {"rounding_seed", OptionForm::kInteger,
       [](const Options& o) { return static_cast<double>(o.rounding_seed()); },
       [](Options& o, double v) { o.rounding_seed(seed_option("rounding_seed", v)); },
       /*optional_in_archives=*/true},
      FUSEDAMP_OPTION_ROW(Options, skip_nonfinite, OptionForm::kFlag),
      FUSEDAMP_OPTION_ROW(Options, adopt_param_edits, OptionForm::kFlag,
                          /*optional_in_archives=*/true),
      FUSEDAMP_OPTION_ROW(Options, write_back_grads, OptionForm::kFlag,
                          /*optional_in_archives=*/true),
      // Checked by check_options(); none (clipping off): clear_group_option.
      {"max_grad_norm", OptionForm::kNumberOrNone,
       [](const Options& o) { return o.max_grad_norm().value_or(0.0); },
       [](Options& o, double v) { o.max_grad_norm(v); }, /*optional_in_archives=*/true,
       [](const Options& o) { return o.max_grad_norm().has_value(); },
       [](Options& o) { o.max_grad_norm(std::nullopt); }},
  };
};

}  // namespace fusedamp::optim::detail
