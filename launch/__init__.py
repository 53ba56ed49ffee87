"""One way to start a process: `pd serve` and `pd proxy` (or anything with a /health
route) are started, health-waited and stopped by PID here, for deploy/, benchmarks/ and
the tests alike. Standard library and httpx only (and tqdm, for `launch.progress`'s bar on
a terminal); nothing of `pd` is imported.

The launcher's names are read from `launch.process` (`free_port` from `launch.ports`) on
first use, so that importing `launch.progress` (which the engine does to show its weights
loading) costs no httpx.
"""

from typing import Any

__all__ = ["LaunchError", "Launched", "deployment_secret", "end_group", "exited", "free_port", "health_status",
           "http_client", "keep_running", "log_tail", "pd_command", "running", "start", "start_logged", "stop_process",
           "terminate_all", "wait_ready", "wait_started"]


def __getattr__(name: str) -> Any:
    if name == "free_port":
        from launch.ports import free_port

        return free_port
    if name in __all__:
        from launch import process

        return getattr(process, name)
    raise AttributeError(f"module 'launch' has no attribute {name!r}")
