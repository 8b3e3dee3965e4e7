"""Fine-tuning a transformers Llama through the Trainer (tests/scripts/hf_trainer.py, one 2-process launch):
``myfsdp`` trains like ``ddp`` with every parameter trainable, with our LoRA adapters and with peft's
``get_peft_model`` LoRA; an adapter checkpoint holds the adapters alone and resumes exactly, and
``convert --to safetensors`` of it gives the adapter tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_fsdp.checkpoint.convert import convert
from tests.engine_harness import RTOL, max_relative_error
from tests.strategy_scripts import run_script

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_trainer")
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=20,
        intermediate_size=30,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out / "pretrained")
    run_script("hf_trainer.py", out, timeout=600)
    return out


def _assert_close(runs: Path, name: str, reference: str) -> None:
    ours, expected = torch.load(runs / f"{name}.pt"), torch.load(runs / f"{reference}.pt")
    assert ours.keys() == expected.keys()
    for key, value in expected.items():
        error = max_relative_error(ours[key], value)
        assert error < RTOL, f"{name} vs {reference}: {key} relative error {error:.1e}"


@pytest.mark.parametrize(
    ("name", "reference"),
    [("rows", "ddp_rows"), ("from_pretrained", "ddp_rows"), ("lora", "ddp_lora"), ("peft", "ddp_peft")],
)
def test_fine_tuning_matches_ddp(runs: Path, name: str, reference: str) -> None:
    _assert_close(runs, name, reference)


def test_the_base_weights_moved_only_where_trainable(runs: Path) -> None:
    pretrained = load_file(runs / "pretrained" / "model.safetensors")
    lora, full = torch.load(runs / "lora.pt"), torch.load(runs / "rows.pt")
    for name, value in pretrained.items():
        assert torch.equal(lora[f"model.{name}"], value), f"frozen {name} changed under LoRA"
    assert any(not torch.equal(full[f"model.{name}"], value) for name, value in pretrained.items())


def test_an_adapter_checkpoint_holds_the_adapters_and_resumes_exactly(runs: Path, tmp_path: Path) -> None:
    checkpoint = runs / "lora" / "epoch=0-step=2.ckpt"
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["state_dict"] and all(name.endswith(("lora_a", "lora_b")) for name in saved["state_dict"])
    assert saved["lightning_fsdp"]["trainable_only"] is True
    (names,) = saved["lightning_fsdp"]["optimizer_param_names"]  # what convert keys the optimizer's state by
    assert sorted(name for group in names for name in group) == sorted(saved["state_dict"])
    resumed, straight = torch.load(runs / "lora_resumed.pt"), torch.load(runs / "lora.pt")
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), f"resumed {name} differs from the uninterrupted run"
    convert(checkpoint, tmp_path / "adapters.safetensors", "safetensors", strip_prefix="model.", quiet=True)
    assert load_file(tmp_path / "adapters.safetensors").keys() == {
        n.removeprefix("model.") for n in saved["state_dict"]
    }


def test_a_peft_lora_trains_its_adapters_only_and_resumes_exactly(runs: Path) -> None:
    checkpoint = torch.load(runs / "peft" / "epoch=0-step=2.ckpt", weights_only=True)
    assert checkpoint["state_dict"] and all(".lora_" in name for name in checkpoint["state_dict"])
    pretrained = load_file(runs / "pretrained" / "model.safetensors")
    peft, resumed = torch.load(runs / "peft.pt"), torch.load(runs / "peft_resumed.pt")
    for name, value in pretrained.items():
        wrapped = name.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        assert torch.equal(peft[f"model.base_model.model.{wrapped}"], value), f"frozen {name} changed under peft"
    adapters = [name for name in peft if ".lora_" in name]
    assert adapters and any(not torch.equal(peft[n], torch.zeros_like(peft[n])) for n in adapters)
    for name, value in peft.items():
        assert torch.equal(resumed[name], value), f"resumed {name} differs from the uninterrupted run"
