"""Prompt templates, one package (issue 26): ``prompt`` builds a model's prompt from the chat core's typed messages
and tools (Go template data as Ollama marshals it, or the JSON a Jinja chat template reads); ``gotemplate`` is the Go
``text/template`` engine; ``jinja`` is the sandbox GGUF Jinja templates run in; ``cache`` holds the byte-bounded
cache of parsed templates; ``offload`` runs the blocking renders off the event loop."""
