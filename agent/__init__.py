"""The per-node agent of elastic-run: CLI, master client, worker group and the restart/rescale loop."""
