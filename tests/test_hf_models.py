"""Hugging Face transformers models under the engine, as users fine-tune them: tiny Llama and Qwen2 models built from
configs (no downloads), random weights saved with ``save_pretrained`` playing the pretrained checkpoint.

One 2-rank run per family checks: ``load_pretrained`` fills the sharded model with exactly the file's weights (one
file, and an index of several); fine-tuning trains with parity against the unsharded model; the trained weights,
exported with ``convert --to hf``, load back with ``from_pretrained`` and give the sharded model's logits.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fsdp import apply_activation_checkpointing, fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.checkpoint.pretrained import load_pretrained
from lightning_fsdp.demos.lora import add_lora
from lightning_fsdp.engine.init.materialize import check_initializable, materialize
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.engine.transport.hosts import HOST_SWITCH
from tests.distributed import run_distributed
from tests.engine_harness import RTOL, max_relative_error

transformers = pytest.importorskip("transformers")

VOCAB, SEQUENCE, LOCAL_BATCH, STEPS = 61, 12, 2, 3


@dataclass(frozen=True)
class Family:
    name: str
    model: str  # class names in transformers
    layer: str
    config: str
    options: tuple[tuple[str, Any], ...]

    def build(self, seed: int) -> torch.nn.Module:
        config = getattr(transformers, self.config)(
            vocab_size=VOCAB,
            hidden_size=20,  # head_dim 10: RoPE needs it even; 61 vocabulary rows divide by neither 2 nor 4
            intermediate_size=30,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            **dict(self.options),
        )
        torch.manual_seed(seed)
        return getattr(transformers, self.model)(config)

    @property
    def layer_class(self) -> type[torch.nn.Module]:
        module = getattr(transformers, self.model).__module__
        return getattr(__import__(module, fromlist=[self.layer]), self.layer)


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", "LlamaDecoderLayer", "LlamaConfig", (("tie_word_embeddings", True),)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "Qwen2DecoderLayer", "Qwen2Config", (("tie_word_embeddings", False),)),
}


def _batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(global batch, this rank's rows) for every step; the same on every rank."""
    data = torch.Generator().manual_seed(1)
    global_batch = LOCAL_BATCH * world_size
    local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return [
        (tokens, tokens[local])
        for tokens in (torch.randint(0, VOCAB, (global_batch, SEQUENCE), generator=data) for _ in range(STEPS))
    ]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-3, eps=1e-5, weight_decay=0.1)


def _train_side_by_side(
    model: torch.nn.Module, reference: torch.nn.Module, rank: int, world_size: int, what: str
) -> dict[str, torch.Tensor]:
    """The sharded model on each rank's rows, the unsharded one on the global batch, AdamW steps; the weights must
    agree (see [Note: parity tolerance] in tests/engine_harness.py). Returns the sharded model's full weights."""
    optimizer, ref_optimizer = _optimizer(model), _optimizer(reference)
    for tokens, local in _batches(rank, world_size):
        model(input_ids=local, labels=local).loss.backward()
        reference(input_ids=tokens, labels=tokens).loss.backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    trained = full_state_dict(model, rank0_only=False)
    for name, value in reference.state_dict().items():
        error = max_relative_error(trained[name], value)
        assert error < RTOL, f"{what}: {name} relative error {error:.1e}"
    return trained


def _assert_equal_state(model: torch.nn.Module, expected: dict[str, torch.Tensor], label: str) -> None:
    full = full_state_dict(model, rank0_only=False)
    assert full.keys() == expected.keys(), f"{label}: keys differ"
    for name, value in expected.items():
        assert torch.equal(full[name], value), f"{label}: {name} differs"


def _fine_tune(rank: int, world_size: int, folder_name: str, family_name: str) -> None:
    family, folder = FAMILIES[family_name], Path(folder_name)
    folder.mkdir(exist_ok=True)
    pretrained = family.build(seed=0)
    if rank == 0:
        pretrained.save_pretrained(folder / "pretrained")
        pretrained.save_pretrained(folder / "pretrained_index", max_shard_size="8KB")  # several files + index
    torch.distributed.barrier()
    assert (folder / "pretrained_index" / "model.safetensors.index.json").is_file()

    # Pretrained weights into a sharded model built with other (random) weights: each rank reads its own rows.
    for source in ("pretrained", "pretrained_index"):
        model = fully_shard(family.build(seed=1), {family.layer_class})
        result = load_pretrained(model, folder / source)
        assert not result.missing and not result.unexpected, result
        _assert_equal_state(model, pretrained.state_dict(), f"{family.name} load_pretrained({source})")

    # Fine-tuning: the sharded model on each rank's rows against the unsharded one on the global batch.
    reference = copy.deepcopy(pretrained)
    trained = _train_side_by_side(model, reference, rank, world_size, f"{family.name} fine-tune")

    # Export through a Lightning-style full checkpoint ("model." is the LightningModule's attribute) -> hf folder.
    probe = torch.randint(0, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    if rank == 0:
        checkpoint = {"state_dict": {f"model.{name}": value for name, value in trained.items()}, "global_step": 3}
        save_full_checkpoint(folder / "trained.ckpt", checkpoint)
        config = folder / "pretrained" / "config.json"
        convert(folder / "trained.ckpt", folder / "export", "hf", quiet=True, config=config)
        convert(
            folder / "trained.ckpt", folder / "export_sharded", "hf", quiet=True, config=config, max_shard_bytes=8000
        )
        assert len(list((folder / "export_sharded").glob("model-*-of-*.safetensors"))) > 1
        for export in ("export", "export_sharded"):
            loaded = getattr(transformers, family.model).from_pretrained(folder / export)
            with torch.no_grad():
                exported_logits = loaded(input_ids=probe).logits
            error = max_relative_error(exported_logits, logits)
            assert error < RTOL, f"{family.name} {export}: logits differ by {error:.1e}"
    torch.distributed.barrier()


def _fine_tune_every_family(rank: int, world_size: int, folder_name: str) -> None:
    for family in sorted(FAMILIES):
        _fine_tune(rank, world_size, str(Path(folder_name) / family), family)


def test_pretrained_load_fine_tune_and_export(tmp_path: Path) -> None:
    run_distributed(_fine_tune_every_family, 2, str(tmp_path), timeout=300)


def _frozen_mixes(rank: int, world_size: int, family_name: str, sharding_strategy: str) -> None:
    """Partly frozen units, as fine-tuning freezes them, trained with parity against the unsharded model."""
    family = FAMILIES[family_name]
    mixes = {
        "norms frozen": lambda name: "norm" in name,
        "only the last layer and the head trainable": lambda name: not name.startswith(("model.layers.1", "lm_head")),
        "LoRA adapters on q and v": None,
    }
    for label, frozen in mixes.items():
        for checkpointing in (False, True):
            reference = family.build(seed=0)
            if frozen is None:
                add_lora(reference, ("q_proj", "v_proj"), rank=2)
                for name, param in reference.named_parameters():  # start off zero, so the base weights matter
                    if name.endswith("lora_b"):
                        torch.nn.init.normal_(param, std=0.02)
            else:
                for name, param in reference.named_parameters():
                    param.requires_grad_(not frozen(name))
            model = copy.deepcopy(reference)
            mesh = {"device_mesh": (2, world_size // 2)} if sharding_strategy == "HYBRID_SHARD" else {}
            fully_shard(model, {family.layer_class}, sharding_strategy=sharding_strategy, **mesh)
            if checkpointing:
                apply_activation_checkpointing(model, {family.layer_class})
            what = f"{family.name} {sharding_strategy} {label}{' + activation checkpointing' if checkpointing else ''}"
            _train_side_by_side(model, reference, rank, world_size, what)
            for name, param in model.named_parameters():
                assert param.requires_grad or param.grad is None, f"{what}: frozen {name} got a gradient"


def _frozen_mixes_every_strategy(rank: int, world_size: int, strategies: tuple[str, ...]) -> None:
    for sharding_strategy in strategies:
        _frozen_mixes(rank, world_size, "llama", sharding_strategy)


@pytest.mark.parametrize(
    ("world_size", "strategies"),
    [(2, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")), (4, ("FULL_SHARD", "HYBRID_SHARD"))],
)
def test_partly_frozen_units_train_with_parity(world_size: int, strategies: tuple[str, ...]) -> None:
    run_distributed(_frozen_mixes_every_strategy, world_size, strategies, timeout=400)


def _between_hosts(rank: int, world_size: int) -> None:
    """Each rank a simulated host of its own: Qwen2's untied ``embed_tokens`` is gathered by the rows its lookups read
    (see [Note: an embedding's rows as they are looked up]); fine-tuning, whole and with LoRA on a frozen base, keeps
    parity, and generation (evaluation forwards: the embedding gathered whole) gives the unsharded tokens."""
    os.environ[HOST_SWITCH] = f"simhost{rank}"
    family = FAMILIES["qwen2"]
    for lora in (False, True):
        reference = family.build(seed=0)
        if lora:
            add_lora(reference, ("q_proj", "v_proj"), rank=2)
        model = fully_shard(copy.deepcopy(reference), {family.layer_class})
        _train_side_by_side(model, reference, rank, world_size, f"qwen2 between hosts{' + LoRA' if lora else ''}")
        looked_up = [rows.param.fqn for unit in units_under(model) for rows in unit.looked_up]
        assert looked_up == ["model.embed_tokens.weight"], looked_up
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(3 + rank))
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        assert model.generate(prompt, **options).tolist() == reference.generate(prompt, **options).tolist()


def test_an_untied_embedding_between_hosts_trains_and_generates_as_unsharded() -> None:
    run_distributed(_between_hosts, 2, timeout=200)


def _generate_uneven(rank: int, world_size: int, folder_name: str) -> None:
    """Greedy generation where one rank meets its end-of-sequence token first: no hang, the unsharded result."""
    family = FAMILIES["llama"]
    plain = family.build(seed=0)
    model = fully_shard(copy.deepcopy(plain), {family.layer_class})
    prompts = torch.randint(0, VOCAB, (world_size, 4), generator=torch.Generator().manual_seed(3))
    prompt = prompts[rank : rank + 1]
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free = [plain.generate(p[None], eos_token_id=None, **options)[0, 4:].tolist() for p in prompts]
    # An end token rank 0 produces at once and no other rank produces at all: rank 0 stops after one token.
    eos = next(token for token in free[0] if all(token not in other for other in free[1:]))
    with torch.no_grad():
        expected = plain.generate(prompt, eos_token_id=eos, **options)
        generated = model.generate(prompt, eos_token_id=eos, **options)  # synced: finished ranks keep stepping
    assert generated.tolist() == expected.tolist(), f"rank {rank}: {generated.tolist()} != {expected.tolist()}"
    lengths = [None] * world_size
    torch.distributed.all_gather_object(lengths, expected.shape[1])
    assert len(set(lengths)) > 1, f"the ranks stopped at the same length {lengths}: the case tests nothing"


def test_generation_with_uneven_lengths_returns_the_unsharded_output(tmp_path: Path) -> None:
    run_distributed(_generate_uneven, 2, str(tmp_path), timeout=120)


def test_a_meta_build_gets_the_rotary_buffers_it_computes_at_init() -> None:
    """Llama's rotary embedding computes its non-persistent ``inv_freq`` in ``__init__``, which a meta build loses:
    without an initialiser its modules are refused by name, and with transformers' own ``_init_weights`` (which
    recomputes the buffers) every tensor is written and the buffers are exactly the eager build's. See [Note:
    tensors no initialiser wrote] in lightning_fsdp/engine/init/materialize.py."""
    eager = FAMILIES["llama"].build(seed=0)
    with torch.device("meta"):
        model = FAMILIES["llama"].build(seed=0)
    with pytest.raises(ValueError, match=r"\(LlamaRMSNorm\) was built on the meta device but has no reset_parameters"):
        check_initializable(model, None)
    check_initializable(model, model._init_weights)
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*materialised from the meta device")
        materialize(model, torch.device("cpu"), model._init_weights, owners, lambda meta, real: None)
    buffers = dict(model.named_buffers())
    for name, expected in eager.named_buffers():
        assert torch.equal(buffers[name], expected), f"{name} differs from the eager build"
    assert not any(bool(torch.isnan(p).any()) for p in model.parameters())
