"""The NIXL connector: scheduler half (scheduler.py), transport and side channel."""
