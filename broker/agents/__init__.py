"""The broker side of the node agent protocol (docs/agent.md): registration, heartbeats,
assignments, status reports, and the sweep that marks silent nodes LOST."""
