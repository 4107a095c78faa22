"""`megarl plan --measure`'s engine (megarl.plan.measure.MeasuredEngine) receives what a real engine worker would: the
trainer's own weight sync (megarl.sync.transports.colocated) writes every piece each worker needs into its parameter
file, and after the sync each worker's boxes equal the actor's exported HF tensors. At TP2 with two engine replicas of
TP1 each rank holds half of every split weight and its worker needs the whole model: the pieces cross ranks, as they do
in the measured MoE and CP runs' layouts."""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model


def sync_into_measured_engine(hf_dir: str, tp: int) -> dict:
    import torch.distributed as dist

    from megarl.bridge.exporter import export_to_dict
    from megarl.layout import EngineTopology, Layout
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import init_model_parallel
    from megarl.plan.measure import MeasuredEngine
    from megarl.sync.factory import build_sync

    class Kept(MeasuredEngine):
        """Also maps each worker's file (before its host unlinks it), to read what the sync wrote."""

        def place_weights(self, needs, prefix):
            reports = super().place_weights(needs, prefix)
            self.arenas = [torch.from_file(r["arena"], shared=True, size=r["size"], dtype=torch.uint8)
                           for r in reports]
            self.reports = reports
            return reports

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    model, spec = build_and_load(hf_dir)
    world = dist.get_world_size()
    topology = EngineTopology(world, 1, world)  # one TP1 replica per rank: each worker needs the whole model
    engine = Kept(spec, topology, 1)
    try:
        sync = build_sync([model], spec, engine, topology, 64 << 10)
        metrics = sync.run(engine)
        hf = export_to_dict([model], spec)
        mismatched, compared = [], 0
        for name, (box, region, offset, sizes, strides, dtype) in (
                (n, recs[0]) for n, recs in engine.reports[0]["placed"].items()):
            typed = engine.arenas[0].view(getattr(torch, dtype))
            got = typed.as_strided(sizes, strides, offset // typed.element_size())
            want = hf[name][tuple(slice(a, b) for a, b in box)]
            compared += 1
            if not torch.equal(got, want):
                mismatched.append(name)
    finally:
        engine.shutdown()
    return {"mismatched": mismatched, "compared": compared, "tensors": len(hf),
            "sent": metrics["weight_sync/sent_bytes_max"], "placed": metrics["weight_sync/placed_bytes"]}


# the default suite runs TP2 (pieces crossing ranks); TP1 is slow
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_the_measured_engine_receives_every_piece_of_the_trainers_sync(tmp_path, tp):
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    out = run_ranks(f"{__name__}:sync_into_measured_engine", tp, {"hf_dir": str(hf_dir), "tp": tp})
    for rank in out:
        assert rank["compared"] == rank["tensors"] > 0 and not rank["mismatched"], rank
        assert rank["placed"] > 0
    # at TP2 the halves a worker lacks come from the other rank; at TP1 nothing moves between ranks
    assert (out[0]["sent"] > 0) == (tp == 2), out
