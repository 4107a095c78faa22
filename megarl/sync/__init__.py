"""Weight sync: the Megatron actor's weights into the engines' TP/EP layout after every update.

* The plan (shards, plan): pure and printable. Who holds which box of every HF tensor (from the bridge's one mapping
  per architecture and the trainer layout) and which box each engine worker's loader reads (from what the live worker
  reports, or predicted from the shapes for `megarl plan`); moves and buckets follow.
* One factory (factory): the bridge mapping and the trainer's holdings (holdings: what every rank holds, the pieces
  cut from its own parameters) built once per run and handed to the transport the recipe picks.
* Colocated engines (delivery, placement; the engine side: megarl.rollout.worker_ext): every engine worker receives only its own shard, from the
  trainer ranks that hold it (p2p), written straight into its parameters where the worker shares them (placed writes)
  or through a shared-memory bucket file that megarl's vLLM worker extension loads with vLLM's own weight loaders.
* Engines in processes of their own (remote): the same plan's pieces over a transfer group of the trainer ranks and
  the engine hosts (gloo on CPU, NCCL on GPU), never through one rank or Ray's object store.
* The wire (wire): the bucket and adapter files in shared memory that the trainer side writes and the worker
  extension reads; both sides import it, neither imports the other.
* Checks (weights): checksums of what each worker holds against what the trainer sent, bucketing of tensor streams.

What the sync needs from an engine is megarl.sync.seam, nothing more.
"""
from megarl.sync.weights import iter_buckets, tensor_checksum

__all__ = ["iter_buckets", "tensor_checksum"]
