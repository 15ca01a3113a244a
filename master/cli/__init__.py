"""``elastic-master``: the daemon, ``elastic-master status`` (``--watch``, ``--json``) and ``readmit``.

Promises: options are validated at the edge into frozen settings; a usage error is one line and exit 2
(DESIGN.md's exit-code table).

Owns: the master's command line, its option groups (``options``) and its terminal views (``status``).
"""
