"""Agentic (multi-turn, tool-calling) rollouts: tools declared in YAML (tools), tool calls parsed from the model's text
(parse), tool turns rendered with the chat template as token ids (render), and the loop that runs many trajectories at
once next to the engine (loop). Enabled by rollout.multi_turn.enable; see docs/multiturn.md."""
