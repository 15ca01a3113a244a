"""``elastic-run``: torchrun's command line, elastic underneath.

Promises: every torchrun flag in both spellings with its ``PET_*`` default (``torchrun_flags``,
``torchrun_compat``); single values checked at the edge (``values``) and resolved once into frozen
:class:`~agent.settings.AgentSettings` (``resolve``); a usage error is one line and exit 2. ``bootstrap``
finds the job master or hosts one in this process: the only place the agent imports :mod:`master`.
"""
