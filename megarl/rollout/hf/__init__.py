"""The transformers engine (rollout.name=hf): HFEngine (engine) over transformers' model with its own KV cache and
decoding (decode), its parameters where the weight sync writes them (weights), and what it refuses (checks)."""
