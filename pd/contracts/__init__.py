"""The types that cross rooms: a request and its sampling parameters, the connector API,
and what the scheduler hands the model runner and gets back. The scheduler, worker,
connectors, server, offload tiers and in-process benchmarks all import this room;
none of them imports the scheduler's. It depends on nothing of ours above the KV core."""
