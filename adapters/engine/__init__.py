"""The torch decode engine: model loading, a batched Llama forward, continuous batching."""
