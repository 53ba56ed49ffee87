"""KV cache core: specs, layout, block pool, hashing, managers, coordinators; no torch math."""
