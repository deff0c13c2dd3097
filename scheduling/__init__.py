"""WhaleZen scheduling library: pure Python, no Django, no I/O, deterministic for an input and seed.

Entry point: `scheduling.engine.schedule(snapshot, policy) -> Plan`. Data model: `scheduling.model`.
"""
