"""``python -m master`` is ``elastic-master``."""

from master.cli import main

main()
