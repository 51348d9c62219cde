"""`dflash serve`: an OpenAI- and Anthropic-compatible HTTP server. `routes.py` is the HTTP side;
`request.py` a checked request (`CompletionRequest`) and the field checks both wire formats
share, `prompts.py` its prompt, `openai_api.py` and `anthropic_api.py` the wire formats;
`output.py` a reply split into text, reasoning and tool calls; `worker.py` the thread that owns
the model, `jobs.py` a request on its way through it and its metrics, `scheduler.py` its continuous
batching, `ranks.py` its followers under `mlx.launch`; `bench.py` tokens/s through running servers."""

#: Requests decoded together at most, by default (`dflash serve --max-batch`; kept here, where the
#: command line reads it without importing MLX).
MAX_BATCH = 8
