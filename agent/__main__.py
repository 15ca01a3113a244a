"""``python -m agent`` is ``elastic-run``."""

from agent.cli import main

main()
