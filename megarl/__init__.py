"""megarl: Megatron-first RL post-training for LLMs."""
import os as _os

__version__ = "0.1.0"

# Large CPU tensors (weight-sync buckets, merged/exported tensors, engine weights re-processed after a sync) are
# allocated fresh and written once: with 4 KiB pages, the page faults of that first write cost several times the
# copy itself. torch's CPU allocator backs allocations >= 2 MiB with transparent huge pages when this is set (read
# at its first allocation, so it is set before megarl imports torch; inherited by every process megarl starts).
# THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# megatron-core's import without torch's compiler stack on CPU and without wandb (see megarl.megatron.lean_import).
from megarl.megatron import lean_import as _lean_import  # noqa: E402

_lean_import.install()
