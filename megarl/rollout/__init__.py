"""Rollout: the generation engines (vLLM), where they run and when they generate. How the actor's weights reach them
after every update is the weight sync's concern (megarl.sync); an engine meets it only at megarl.sync.seam.

Where engines run (rollout.placement = "colocated", the default)
---------------------------------------------------------------------------------------------
* rollout.data_parallel_size engine replicas over the trainer's ranks (megarl.rollout.replicas): replica r spans
  rollout.tensor_model_parallel_size consecutive ranks and its first rank owns it, as a child process
  (megarl.rollout.process: vLLM's own process group must not mix with the trainer's); engine TP > 1 runs vLLM's
  multi-process executor, one worker per rank of the group.
* Prompts: each replica generates its contiguous share (seeds by global prompt index) and broadcasts it as tensors.

Placed separately (rollout.placement = "separate"; Ray actors always are): each replica runs in a host process of its
own (a Ray actor, megarl.rollout.ray_engine, or an engine process on cores of its own).

The rest: vLLM's arguments from the config, the model and the machine (engine_args; the CPU's kernels: cpu_engine),
request-level control of an engine (requests), the engine interface (protocol), CPU threads of an engine (threads),
and when each step's batch is generated with which weights (schedule).
"""
from megarl.rollout.engine import PromptTooLongError, VLLMEngine, apply_prompt_overflow
from megarl.rollout.engine_args import engine_kwargs, kv_cache_bytes_needed
from megarl.rollout.protocol import EngineStartError
from megarl.rollout.sampling import sampling_kwargs

__all__ = ["VLLMEngine", "EngineStartError", "PromptTooLongError", "apply_prompt_overflow", "engine_kwargs",
           "sampling_kwargs", "kv_cache_bytes_needed"]
