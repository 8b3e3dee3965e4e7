"""LitGPT on one process: built once in configure_model, parameter groups and freezing by name, the schedule,
perplexity, fine-tuning from a checkpoint, prediction. The multi-process runs are in test_cli_configs.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.gpt import GPT, GPTConfig
from lightning_fsdp.demos.lit_gpt import LitGPT, freeze_by_prefix, split_weight_decay, warmup_cosine

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}


def tiny_data() -> CharDataModule:
    return CharDataModule(max_bytes=20_000, block_size=16, batch_size=4)


def tiny_trainer(root: Path, **kwargs: object) -> Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 1,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
    }
    return Trainer(**{**options, **kwargs})


def test_configure_model_builds_the_gpt_once() -> None:
    module = LitGPT(**TINY)
    assert module.model is None  # nothing is built in __init__: the strategy's init context decides where
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model
    assert isinstance(model, GPT) and model.config.n_layer == 2 and model.config.vocab_size == 256


def test_weight_decay_groups_follow_module_and_attribute_names() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8))
    decay, no_decay = split_weight_decay(model)
    assert set(decay) == {
        "wte.weight",  # tied to lm_head.weight, the output projection
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc.weight",
        "blocks.0.mlp.proj.weight",
    }
    assert "wpe.weight" in no_decay and "ln_f.weight" in no_decay and "blocks.0.ln_1.bias" in no_decay
    assert not any(name in decay for name in no_decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_weight_decay_groups_ignore_shapes() -> None:
    # A rank's shard of a matrix may have a single row, or none; the groups must not change with it.
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8))
    expected = {name: set(group) for name, group in zip(("decay", "no_decay"), split_weight_decay(model), strict=True)}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            setattr(module, attr, torch.nn.Parameter(param.detach()[:1].reshape(-1)))
    model.lm_head.weight = model.wte.weight
    decay, no_decay = split_weight_decay(model)
    assert set(decay) == expected["decay"] and set(no_decay) == expected["no_decay"]


def test_freeze_matches_dotted_prefixes_and_both_names_of_a_tied_weight() -> None:
    model = GPT(GPTConfig(n_layer=11, n_head=2, n_embd=8, block_size=8))
    freeze_by_prefix(model, ["lm_head", "blocks.1"])
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    assert "wte.weight" in frozen  # lm_head.weight is wte.weight
    assert {name for name in frozen if name.startswith("blocks.")} == {
        name for name, _ in model.named_parameters() if name.startswith("blocks.1.")
    }  # blocks.10 is not under "blocks.1"
    decay, no_decay = split_weight_decay(model)
    assert not frozen & (set(decay) | set(no_decay))  # frozen parameters get no optimizer state


def test_freeze_refuses_an_unknown_prefix_and_freezing_everything() -> None:
    with pytest.raises(
        ValueError, match=r"'block\.0' matches no parameter .* \['blocks', 'lm_head', 'ln_f', 'wpe', 'wte'\]"
    ):
        freeze_by_prefix(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8)), ["block.0"])
    with pytest.raises(ValueError, match="freezes every parameter"):
        freeze_by_prefix(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8)), ["wte", "wpe", "blocks", "ln_f"])


def test_warmup_then_cosine_down_to_the_floor() -> None:
    def lr(step: int, total: float = 110) -> float:
        return warmup_cosine(step, warmup_steps=10, total_steps=total, min_lr_ratio=0.1)

    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0) and lr(60) == pytest.approx(0.55)
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)
    assert lr(1000, total=math.inf) == pytest.approx(1.0)  # no step limit: no decay


def test_fit_validate_test_log_perplexity_as_exp_of_the_loss(tmp_path: Path) -> None:
    module = LitGPT(**TINY, warmup_steps=1)
    trainer = tiny_trainer(tmp_path)
    trainer.fit(module, datamodule=tiny_data())
    (validated,) = trainer.validate(module, datamodule=tiny_data(), verbose=False)
    assert validated["val_ppl"] == pytest.approx(math.exp(validated["val_loss"]), rel=1e-4)
    (tested,) = trainer.test(module, datamodule=tiny_data(), verbose=False)
    assert math.exp(tested["test_loss"]) == pytest.approx(tested["test_ppl"], rel=1e-4) and tested["test_ppl"] < 256


def test_predict_continues_each_prompt(tmp_path: Path) -> None:
    module = LitGPT(**TINY, max_new_tokens=5)
    (tokens,) = tiny_trainer(tmp_path).predict(module, datamodule=tiny_data())
    assert tokens.shape == (4, 5) and tokens.dtype == torch.long and 0 <= tokens.min() and tokens.max() < 256


def test_fine_tuning_starts_from_the_checkpoint_and_keeps_frozen_weights(tmp_path: Path) -> None:
    pretrain = tiny_trainer(tmp_path)
    pretrain.fit(LitGPT(**TINY), datamodule=tiny_data())
    pretrained = tmp_path / "pretrained.ckpt"
    pretrain.save_checkpoint(pretrained)
    start = {name: t.clone() for name, t in torch.load(pretrained, weights_only=True)["state_dict"].items()}

    module = LitGPT(**TINY, pretrained=str(pretrained), freeze=["wte", "wpe", "blocks.0"])
    finetune = tiny_trainer(tmp_path)
    finetune.fit(module, datamodule=tiny_data())
    after = module.state_dict()
    assert module.model.lm_head.weight is module.model.wte.weight  # loading kept the tie
    for name in ("model.wte.weight", "model.lm_head.weight", "model.wpe.weight", "model.blocks.0.mlp.fc.weight"):
        assert torch.equal(after[name], start[name]), name
    assert not torch.equal(after["model.blocks.1.mlp.fc.weight"], start["model.blocks.1.mlp.fc.weight"])

    # The fine-tuned checkpoint stands alone: it needs the pre-training file no more.
    finetuned = tmp_path / "finetuned.ckpt"
    finetune.save_checkpoint(finetuned)
    pretrained.unlink()
    reloaded = LitGPT.load_from_checkpoint(finetuned)
    assert reloaded.hparams.pretrained is None and reloaded.hparams.freeze == ["wte", "wpe", "blocks.0"]
    assert torch.equal(reloaded.model.blocks[1].mlp.fc.weight, after["model.blocks.1.mlp.fc.weight"])


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(LitGPT(**TINY), datamodule=tiny_data())
    trainer.save_checkpoint(tmp_path / "small.ckpt")
    wider = LitGPT(**{**TINY, "n_embd": 32}, pretrained=str(tmp_path / "small.ckpt"))
    with pytest.raises(ValueError, match="does not fit this LitGPT; give the model the hyperparameters"):
        wider.configure_model()
    with pytest.raises(ValueError, match="is a folder"):
        LitGPT(**TINY, pretrained=str(tmp_path)).configure_model()


def test_heads_must_divide_the_width() -> None:
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be a multiple of n_head \(4\)"):
        LitGPT(n_embd=30, n_head=4)
