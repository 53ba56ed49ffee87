"""The engine: the step loop (core.py), its process and IPC (process.py, client.py)."""
