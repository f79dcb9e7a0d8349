"""One module per command (or small group); ``cli.main`` registers them on the typer app."""
