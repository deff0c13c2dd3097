"""Trace-driven simulation: array cluster, placement protocol, baseline and WhaleZen policies."""
