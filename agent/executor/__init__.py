"""The agent's executor: it turns what happens into events for the machine and performs its actions.

Promises: ``loop`` owns every thread, process and call of the agent and decides nothing: it performs each
action of agent.machine through one table (``loop.PERFORMERS``), builds each round's worker environment
and routes signals; ``master_link`` holds the one poll loop every call to the master runs in (a named
policy per call: deadline, backoff, which errors retry, what a final error does) and the long-poll threads;
``heartbeats`` beats under that loop; ``inprocess`` keeps live workers across rounds when the machine says
pause (probe, pause, wait, resume, fallback record); ``health`` runs the hang checks and the node check.

Raises: ``agent.errors.AgentError`` from ``ElasticAgent.run`` when the machine exits with an error.

Owns: the node view that heartbeats report (``node_view``), TLS trouble with the master (``tls_trouble``).
"""
