"""WhaleZen node agent: reads GPUs through NVML, registers with the broker, runs assigned jobs.

Standard library plus `nvidia-ml-py` (module `pynvml`) only, so it installs on a bare GPU node
without Django. See docs/agent.md for the HTTP protocol and the CLI.
"""

AGENT_VERSION = "0.1.0"
