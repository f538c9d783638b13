"""bench_master_modes.py's parts: the rows compared (rows), the step time (timing), the accuracy
(accuracy), the report (report); bench_state_formats.py and split_identity.py use them too."""
