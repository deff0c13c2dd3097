"""WhaleZen benchmarks: `python -m bench.fragmentation`, `bench.scale`, `bench.cost` (see README)."""
