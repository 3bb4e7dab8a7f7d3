"""`python -m radixd.server ...` is the `radixd` command."""
from .cli import main

main()
