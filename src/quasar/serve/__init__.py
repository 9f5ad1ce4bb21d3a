"""OpenAI-compatible HTTP server: a thin adapter over Engine.run(); no generation logic lives here."""
