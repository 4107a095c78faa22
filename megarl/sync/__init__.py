"""Weight sync: the Megatron actor's weights into the engines' TP/EP layout after every update.

The plan, pure and printable, computed once per run:
* boxes: a part of a tensor, one (start, stop) per dimension;
* shards: who holds which box of every HF tensor (from the bridge's one mapping per architecture and the trainer
  layout) and which box each engine worker's loader reads (from what the live worker reports, or predicted from the
  shapes for `megarl plan`); moves: each piece with its source rank, grouped into buckets; plan: the same for
  `megarl plan` without processes;
* holdings: what every trainer rank holds, and copies: where each of its pieces lies in its parameters, compiled to
  strided views, so that an update only resolves each parameter's current storage and copies.

The transports (transports/, one file each; factory picks one from the recipe):
* colocated: engines on the trainer's ranks; each worker's pieces reach it from the ranks that hold them (p2p),
  through reused shared-memory bucket files (common) or written straight into its parameters / pulled by it
  (placed: megarl.sync.placement on CPU, megarl.sync.pull on GPU);
* remote: engines in processes of their own (Ray actors, rollout.placement=separate), over a transfer group of the
  trainer ranks and the engine hosts (transfer), full or delta updates (delta);
* adapter: only the LoRA adapters after each update; feed: a stream of full tensors (verify, tests, benches).

What both sides agree on: wire (the bucket and adapter files), transfer (the transfer group, each host's
ReceivePlan), placement and pull (the placed-write records). The engine side (megarl.rollout.vllm.worker_ext,
megarl.rollout.hosting.receiver) imports those and nothing else of the trainer side. Checks (weights): checksums of what
each worker holds against what the trainer sent. What the sync needs from an engine is megarl.sync.seam.
"""
from megarl.sync.weights import iter_buckets, tensor_checksum

__all__ = ["iter_buckets", "tensor_checksum"]
