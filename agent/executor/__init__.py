"""The agent's executor: it turns what happens into events for the machine and performs its actions.

Promises: ``loop`` owns every thread, process and call of the agent and decides nothing; it talks to the
master (``master_link``, ``heartbeats``), builds each round's worker environment (``round_spec``), keeps
live workers across rounds for in-process recovery (``inprocess_hub``, ``inprocess_steps``), runs the
health duties (``health``), starts and stops the agent's parts in order (``startup``) and forwards
signals (``signals``).

Owns: the node view that heartbeats report (``node_view``).
"""
