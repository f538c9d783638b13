"""bench_distributed.py's parts: the engines (engines), one rank's run (rank_main), the counting
of collectives (collectives), the summary over ranks and launches (summary), the report
(report)."""
