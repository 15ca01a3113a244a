"""``python -m master`` is ``elastic-master``."""

from master.cli.main import main

main()
