"""The chat core: messages to a prompt (renderers, templates) and generated text back to messages (parsers), as
typed events that every dialect (Ollama, OpenAI, Anthropic, Responses) translates. Pure: no FastAPI, no runner."""
