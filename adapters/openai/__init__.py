"""The OpenAI-compatible HTTP boundary: JSON in, GenerationRequests to the controller, SSE out."""
