"""The device's local OpenAI-compatible generation endpoint."""
