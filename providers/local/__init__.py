"""Local provider: node agents as processes with fake GPUs; a simulated cloud."""
from providers.local.provider import (
    DEFAULT_SHAPES,
    JOIN_TOKEN_ENV,
    CloudSimulation,
    LocalProvider,
    LocalShape,
    agent_command,
)

__all__ = ["DEFAULT_SHAPES", "JOIN_TOKEN_ENV", "CloudSimulation", "LocalProvider", "LocalShape", "agent_command"]
