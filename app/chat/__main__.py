"""`python -m app.chat`: the `dflash-chat` command."""

from app.chat.main import main

main()
