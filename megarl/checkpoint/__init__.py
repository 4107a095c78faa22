"""Checkpoints: HF-format output from the bridge's export stream (and, later, resumable training state)."""
