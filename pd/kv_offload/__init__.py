"""KV offload tiers: full blocks of the prefix cache copied to lower tiers (host memory,
local disk through NIXL's POSIX backend) as they are cached, and loaded back into free
blocks when a request's prefix is found there and no longer on the device.

- `index.py`: what one tier holds (scheduler side): slots by (block hash, group), LRU.
- `lookup.py`: the longest prefix past the device hit that the tiers can fill, per the
  groups' cache-hit rules.
- `tier.py`: what every tier is (worker side); `host.py` and `disk.py` are the two
  (disk: one file of slots, a checksum per slot, an index snapshot for a warm restart).
- `worker.py`, `connector.py`: the worker and scheduler halves, wrapped around the
  engine's KV connector, so a tier load is parked and ended like a remote load.
"""
