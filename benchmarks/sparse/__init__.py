"""Parts of bench_sparse.py: the FBGEMM side (fbgemm_side.py)."""
