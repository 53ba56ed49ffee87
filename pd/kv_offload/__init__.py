"""KV offload tiers: full blocks of the prefix cache copied to a lower tier (local disk,
through NIXL's POSIX backend) as they are cached, and loaded back into free blocks when
a request's prefix is found there and no longer on the device.

- `index.py`: what one tier holds (scheduler side): slots by (block hash, group), LRU.
- `lookup.py`: the longest prefix past the device hit that the tier can fill, per the
  groups' cache-hit rules.
- `disk.py`: the disk tier's bytes (worker side): one file of slots, a checksum per
  slot, an index snapshot for a warm restart, NIXL transfers.
- `connector.py`: both halves wrapped around the engine's KV connector, so a tier load
  is parked and ended like a remote load.
"""
