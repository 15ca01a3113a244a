"""The local worker group: spawn, supervise and stop the training processes of one node.

Promises: workers get torchrun's environment contract (``environment``); a worker exit is seen the moment
it happens (a child watcher, never a sleep loop); stopping ends every process a worker started, also one
that left its session and parent (the agent is a child subreaper), and signals no process that took a
reaped one's PID (``tree``); if the agent dies, a sentinel process kills the workers' process groups
(``reaper``); worker output is prefixed per rank (``output``, ``filtered_log``); error files name the root
cause (``errors_file``).

Owns: the worker processes of this node.
"""
