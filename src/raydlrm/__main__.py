"""``python -m raydlrm``: the command line."""

from raydlrm.platform.cli import main

main()
