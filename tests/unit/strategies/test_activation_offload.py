"""Activation offload: bit-identical gradients; a no-op on CPU runs."""

import logging
from contextlib import nullcontext

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.strategies.activation_offload import OffloadActivations, activation_offload


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).train()


def _batch():
    ids = torch.randint(0, 259, (4, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _grads(context):
    model = _model()
    with context(model) as offload:
        loss = model(**_batch()).loss
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, offload


def test_gradients_identical_through_pack_and_unpack():
    # force=True copies every saved activation even on a CPU run, so the real pack/unpack path runs.
    reference, _ = _grads(lambda model: OffloadActivations(model.parameters(), min_bytes=0, force=False))
    grads, offload = _grads(lambda model: OffloadActivations(model.parameters(), min_bytes=0, force=True))
    assert offload.offloaded_bytes > 0
    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name  # bit-identical, not just close


class _Recording(OffloadActivations):
    """Remembers the storages it copied."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copied = set()

    def _pack(self, tensor):
        packed = super()._pack(tensor)
        if not isinstance(packed, torch.Tensor):
            self.copied.add(tensor.untyped_storage().data_ptr())
        return packed


def test_parameters_and_small_tensors_stay():
    model = _model()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with _Recording(model.parameters(), min_bytes=0, force=True) as everything:
        model(**_batch()).loss
    with _Recording(model.parameters(), min_bytes=1 << 30, force=True) as nothing:
        model(**_batch()).loss
    assert everything.copied and not everything.copied & weights  # linear layers save their weights too
    assert nothing.offloaded_bytes == 0 and not nothing.copied


def test_cpu_run_is_a_noop_and_says_so(caplog, monkeypatch):
    import memfit.strategies.activation_offload as module

    monkeypatch.setattr(module, "_SAID_NOOP", False)  # it says so once per process
    with caplog.at_level(logging.INFO, logger="memfit.strategies.activation_offload"):
        factory = activation_offload(True, torch.device("cpu"))
    assert factory().__class__.__name__ == "nullcontext"
    assert "no-op" in caplog.text
    assert activation_offload(False, torch.device("cuda"))().__class__.__name__ == "nullcontext"


def test_traced_estimate_drops_the_offloaded_bytes():
    """The planner's fake run for a CUDA target: saved activations leave the device and come back in backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.memory.tracker import MemoryTracker

    def activations_after_forward(offload: bool):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _model()
            factory = activation_offload(offload, torch.device("cuda"), model.parameters(), min_bytes=0, traced=True)
            with MemoryTracker() as tracker:
                tracker.tag_module(model)
                with tracker.phase("forward"), factory() as offloaded:
                    loss = model(**_batch()).loss
                saved = tracker.current_by_category()["activations"]
                with tracker.phase("backward"):
                    loss.backward()  # the re-created tensors must satisfy autograd
        return saved, getattr(offloaded, "offloaded_bytes", 0)

    kept, _ = activations_after_forward(False)
    left, offloaded = activations_after_forward(True)
    assert left <= 0.05 * kept  # what stays: the loss and tensors under min_bytes (none here)
    assert offloaded == pytest.approx(kept, rel=0.05)


def test_checkpointed_layer_inputs_go_to_the_host():
    """Offloaded checkpoints: with every layer checkpointed, what a layer saves is its input, and
    that input passes through the offload hooks too, so after the forward the device holds none of it."""
    from memfit.build import build_run
    from memfit.config import load_config
    from memfit.memory.tracker import MemoryTracker

    cfg = load_config(None, ["model=memfit/tiny-llama", "model.init=random", "device=cpu", "batch.micro_batch=2",
                             "data.seq_len=128", "memory.checkpointing=full"])
    run = build_run(cfg, torch.device("cpu"))
    ids = torch.randint(0, run.model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def after_forward(offload: bool):
        with MemoryTracker() as tracker:
            tracker.tag_module(run.model)
            context = OffloadActivations(run.params, min_bytes=0, force=True) if offload else nullcontext()
            with tracker.phase("forward"), context:
                loss = run.model(**batch).loss
            saved = tracker.current_by_category()["activations"]
            with tracker.phase("backward"):
                loss.backward()
        run.model.zero_grad(set_to_none=True)
        return saved, getattr(context, "offloaded_bytes", 0)

    kept, _ = after_forward(False)
    left, offloaded = after_forward(True)
    layer_inputs = run.model.config.num_hidden_layers * 2 * 128 * run.model.config.hidden_size * 4  # fp32
    assert kept >= layer_inputs  # checkpointing keeps (at least) each layer's input
    assert offloaded >= layer_inputs and left <= 0.05 * kept


def _checkpointed_run():
    from memfit.build import build_run
    from memfit.config import load_config

    cfg = load_config(None, ["model=memfit/tiny-llama", "model.init=random", "device=cpu", "batch.micro_batch=2",
                             "data.seq_len=128", "memory.checkpointing=full"])
    torch.manual_seed(0)
    run = build_run(cfg, torch.device("cpu"))
    ids = torch.randint(0, run.model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    return run, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_prefetch_brings_the_next_layer_input_back_early_with_identical_gradients(monkeypatch):
    import memfit.strategies.activation_offload as module

    fetched_early = []
    start_fetch = module._Packed.start_fetch

    def counting(packed):
        fetched_early.append(packed.size)
        start_fetch(packed)

    monkeypatch.setattr(module._Packed, "start_fetch", counting)

    def grads(prefetch: bool):
        run, batch = _checkpointed_run()
        with OffloadActivations(run.params, min_bytes=0, force=True, prefetch=prefetch):
            loss = run.model(**batch).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}

    plain = grads(False)
    assert not fetched_early
    early = grads(True)
    for name, grad in plain.items():
        assert torch.equal(early[name], grad), name
    hidden = _checkpointed_run()[0].model.config.hidden_size
    layers = _checkpointed_run()[0].model.config.num_hidden_layers
    # every layer but the first (in forward order) has its input fetched while the later layer runs
    assert sum(1 for size in fetched_early if tuple(size) == (2, 128, hidden)) >= layers - 1
