"""The `pd` command: one entry point for every subcommand (cli/main.py)."""
