"""``python -m agent`` is ``elastic-run``."""

from agent.cli.main import main

main()
