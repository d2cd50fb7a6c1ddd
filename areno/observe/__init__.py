"""Observability: metric sinks (metrics.py), performance traces (trace.py), agent session traces
(session.py), the run report (report.py) and environment checks (doctor.py)."""
