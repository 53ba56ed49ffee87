"""The scheduler and its parts: its PD part (remote KV), fair share, prompt sources and
the runner's view. The types it shares with other rooms are in pd/contracts/; only the
engine core imports this room."""
