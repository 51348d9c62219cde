"""`dflash serve`: an OpenAI- and Anthropic-compatible HTTP server. `routes.py` is the HTTP side,
`openai_api.py` and `anthropic_api.py` the wire formats, `output.py` a reply split into text,
reasoning and tool calls, `worker.py` the thread that owns the model, `ranks.py` its followers
under `mlx.launch`, and `bench.py` tokens/s measured through running servers."""
