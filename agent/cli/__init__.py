"""``elastic-run``: torchrun's command line, elastic underneath.

Promises: every torchrun flag in both spellings with its ``PET_*`` default (options in ``main``, torchrun's
process and log flags and their judgement in ``torchrun``); the parsed options resolved once into frozen
:class:`~agent.settings.AgentSettings` (``resolve``); a usage error is one line and exit 2. ``startup``
starts the agent's parts in order and stops them in reverse; it finds the job master or hosts one in this
process, the only place the agent imports :mod:`master`.
"""
