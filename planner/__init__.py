"""`pd planner`: sizes a fleet's prefill and decode pools by SLO (docs/architecture.md, The planner)."""
