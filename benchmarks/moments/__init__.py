"""moment_formats.py's parts (momentum_formats.py uses formats and tasks too): the storage formats
(formats), the training tasks (tasks), the reference AdamW (reference), the diagnostic
(diagnostic), the runs and the rule (runs), the tables (report) and the reading (reading)."""
