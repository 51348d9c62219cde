"""`python -m app.cli`: the `dflash` command."""

from app.cli.main import main

main()
