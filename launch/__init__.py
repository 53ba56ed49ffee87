"""One way to start a process: `pd serve` and `pd proxy` (or anything with a /health
route) are started, health-waited and stopped by PID here, for deploy/, benchmarks/ and
the tests alike. Standard library and httpx only; nothing of `pd` is imported.

The launcher is `launch.process`; `free_port` is `launch.ports`'s. `launch.ray_actors`
starts the same servers as Ray actors; it needs Ray, and is imported only where Ray is
used (it is not imported here).
"""

from launch.ports import free_port
from launch.process import (
                            Launched,
                            LaunchError,
                            deployment_secret,
                            end_group,
                            exited,
                            health_status,
                            http_client,
                            keep_running,
                            log_tail,
                            pd_command,
                            running,
                            start,
                            start_logged,
                            stop_process,
                            terminate_all,
                            wait_ready,
                            wait_started,
)

__all__ = ["LaunchError", "Launched", "deployment_secret", "end_group", "exited", "free_port", "health_status",
           "http_client", "keep_running", "log_tail", "pd_command", "running", "start", "start_logged", "stop_process",
           "terminate_all", "wait_ready", "wait_started"]
