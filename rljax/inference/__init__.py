"""The rollout engine: paged KV cache, continuous batching, ragged paged attention."""
