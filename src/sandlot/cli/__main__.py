"""``python -m sandlot.cli``."""

from . import main

main()
