"""bench_step.py's parts: the configurations compared (configs), their measurement (measure),
the report (report)."""
