"""bench_host_overhead.py's parts: the sides timed (sides), the rows and their timing (rows), the
table (report)."""
