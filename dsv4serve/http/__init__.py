"""`serve --http`: an OpenAI-compatible HTTP server (hypercorn's trio worker) on the engine's actors."""
