"""Checkpoints: resumable training state (state.py: models, optimizers, data position, RNG; atomic saves) and
HF-format output from the bridge's export stream (hf_writer.py)."""
