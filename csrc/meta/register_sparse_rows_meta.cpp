// Meta kernels of the row-wise sparse step operators: they update their arguments in place
// and return nothing, so shape propagation (torch.compile, export, FakeTensor) needs only the
// argument checks (ops/sparse_rows_args.h); the index range is data and is checked by the
// device kernels.
#include <torch/library.h>

#include "../ops/sparse_rows_args.h"

namespace fusedamp::meta {
namespace {

struct CheckOnlySparseRows {
  static void sparse_rows_step(const kernels::SparseRowsOp&) {}
};

}  // namespace
}  // namespace fusedamp::meta

TORCH_LIBRARY_IMPL(fusedamp, Meta, m) {
  fusedamp::kernels::implement_sparse_row_ops<fusedamp::meta::CheckOnlySparseRows>(m);
}
