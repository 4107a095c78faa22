"""Counts what the weight sync builds per run: bridge mappings (Mapping constructions) and walks over the model's
parameters for the trainer's holdings (megarl.bridge.sharding.local_params). A sync is planned once per run and
each later run of it reuses that plan, so a transport that rebuilt either shows up as a count above one."""
from contextlib import contextmanager
from unittest import mock


@contextmanager
def counting_sync_builds(counts=None):
    """While active, adds the mappings and holdings built to `counts` ({"mappings": n, "holdings": n}, a new one by
    default) and yields it; pass one dict to several blocks to count over the plan and every sync of a run but not
    over what the test does between them (an export builds a mapping of its own). Holdings are counted at the
    parameter walk that every builder of them runs (looked up at call time, so any caller is seen)."""
    import megarl.bridge.sharding as sharding
    from megarl.bridge.mapping import Mapping

    counts = {"mappings": 0, "holdings": 0} if counts is None else counts
    init, walk = Mapping.__init__, sharding.local_params

    def counted_init(self, *args, **kwargs):
        counts["mappings"] += 1
        init(self, *args, **kwargs)

    def counted_walk(*args, **kwargs):
        counts["holdings"] += 1
        return walk(*args, **kwargs)

    with mock.patch.object(Mapping, "__init__", counted_init), mock.patch.object(sharding, "local_params",
                                                                               counted_walk):
        yield counts
