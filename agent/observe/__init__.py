"""What the agent sees of its workers and shows operators: progress, hangs, stacks, metrics, events.

Promises: workers' progress datagrams are read from a local socket (``channel``, which also counts the
workers' checkpoint-save times into a histogram); hang verdicts are pure (``hang``) and a hung worker's
Python stack is recorded before it is killed (``stackdump``); the agent's own Prometheus metrics
(``metrics``), progress line (``progress``) and torchrun's event log (``events``).
"""
