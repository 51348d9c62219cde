"""`dflash-chat`: the terminal chat (Textual). `main.py` is its command line, `app.py` the app,
`commands.py` its slash commands, `widgets.py`, `session.py` and `chat.tcss` what it shows, and
`engine.py` the thread that owns the model."""
