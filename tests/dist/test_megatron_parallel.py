"""A real megatron-core GPTModel at TP=2 and PP=2 over gloo computes the same loss as one rank with the same weights."""
import pytest

from megarl.launch_local import run_ranks

HIDDEN, HEADS, LAYERS, VOCAB, SEQ, MICRO, N_MICRO = 64, 4, 4, 128, 32, 2, 3


def _model(tp: int, pp: int):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def _batches():
    import torch

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(N_MICRO):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        pos = torch.arange(SEQ).expand(MICRO, SEQ).contiguous()
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).expand(MICRO, 1, SEQ, SEQ)
        out.append((tokens, torch.roll(tokens, -1, dims=1), pos, mask))
    return out


def _forward_losses(model, pp: int) -> list:
    """Mean token loss of each micro-batch through megatron's pipeline schedule (forward only)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(it, m):
        tokens, labels, pos, mask = next(it)
        out = m(tokens, pos, mask, labels=labels)
        return out, lambda t: (t.mean(), {"loss": t.mean().detach()})

    with torch.no_grad():
        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(_batches()), model=model,
                                          num_microbatches=N_MICRO, seq_length=SEQ, micro_batch_size=MICRO,
                                          forward_only=True)
    return [r["loss"].item() for r in res]  # empty on stages other than the last


def reference_rank(path: str):
    import torch
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=11)
    model = _model(1, 1)
    torch.save({k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, path)
    return _forward_losses(model, 1)


def sharded_rank(path: str, tp: int, pp: int):
    import torch
    from megatron.core import parallel_state as ps
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=99)
    model = _model(tp, pp)
    full = torch.load(path)
    offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // pp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    state = {}
    for name, local in model.state_dict().items():
        if "_extra_state" in name:
            continue
        key = name
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + offset)
            key = ".".join(parts)
        if key == "output_layer.weight" and key not in full:  # tied embeddings: the last stage holds a copy
            key = "embedding.word_embeddings.weight"
        tensor = full[key]
        p = params.get(name)
        if p is not None and getattr(p, "tensor_model_parallel", False):
            tensor = tensor.chunk(tp, dim=p.partition_dim)[tp_rank]
        assert tensor.shape == local.shape, (name, tensor.shape, local.shape)
        state[name] = tensor
    model.load_state_dict(state, strict=False)
    losses = _forward_losses(model, pp)  # every stage must run the schedule; only the last one sees losses
    return losses if ps.is_pipeline_last_stage() else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "full.pt")
    losses = run_ranks(f"{__name__}:reference_rank", 1, {"path": path}, timeout=300)[0]
    return path, losses


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_sharded_loss_equals_single_rank(reference, tp, pp):
    path, ref_losses = reference
    results = run_ranks(f"{__name__}:sharded_rank", tp * pp, {"path": path, "tp": tp, "pp": pp}, timeout=300)
    last_stage = [r for r in results if r is not None]
    assert last_stage, "no rank reported losses"
    for losses in last_stage:
        assert len(losses) == N_MICRO
        print(f"[measured] tp{tp} pp{pp} loss diff {max(abs(g - w) for g, w in zip(losses, ref_losses)):.2e}")
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) < 1e-5, (losses, ref_losses)
    # the reference must be a real loss of a random model on 128 tokens, not a degenerate value
    assert all(4.0 < x < 6.0 for x in ref_losses), ref_losses
