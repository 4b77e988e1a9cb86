"""``python -m server.cli`` = the ``kvgate`` command."""

from server.cli import main

main()
