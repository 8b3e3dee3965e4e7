"""Fine-tune a Hugging Face causal language model with LoRA, sharded over 2 CPU processes, and export it back.

    python examples/finetune_hf.py --make-tiny runs/tiny_llama     # a tiny random Llama to play the pretrained one
    python examples/finetune_hf.py --pretrained runs/tiny_llama     # LoRA fine-tune on the stdlib sources' bytes
    python examples/finetune_hf.py --pretrained PATH --lora-rank 0 --load from_pretrained

``--pretrained`` is a ``save_pretrained`` folder (``config.json`` and safetensors weights); nothing is downloaded.
The model (``lightning_fsdp.demos.hf_causal_lm.HFCausalLM``) is built from its config, every decoder layer becomes a
sharding unit, and each rank reads only its rows of the pretrained weights (``--load rows``; ``from_pretrained``
holds the whole model on every rank first). With LoRA, checkpoints hold the adapters alone
(``save_trainable_only``). At the end the trained model -- adapters merged into their base weights -- is written as
a folder transformers reads (``lightning-fsdp convert --to hf``), loaded back with ``from_pretrained``, and asked to
continue a prompt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.hf_causal_lm import HFCausalLM
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run


def make_tiny_llama(folder: Path) -> None:
    """A 2-layer Llama over bytes (vocabulary 256), saved as a pretrained model would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    print(f"wrote {folder.resolve()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-tiny", type=Path, help="write a tiny random Llama to this folder and stop")
    parser.add_argument("--pretrained", type=Path, help="a save_pretrained folder to fine-tune")
    parser.add_argument("--load", choices=("rows", "from_pretrained"), default="rows")
    parser.add_argument("--lora-rank", type=int, default=8, help="0 trains every parameter (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/finetune_hf"), help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.make_tiny is None and (args.pretrained is None or not (args.pretrained / "config.json").is_file()):
        parser.error("pass --pretrained FOLDER (with config.json), or --make-tiny FOLDER to create one")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make_tiny is not None:
        make_tiny_llama(args.make_tiny)
        return
    seed_everything(0)
    model = HFCausalLM(str(args.pretrained), load=args.load, lora_rank=args.lora_rank, lr=1e-3)
    # No auto_wrap_policy: the strategy finds the repeated decoder layers and makes each a unit.
    strategy = FSDPStrategy(save_trainable_only=args.lora_rank > 0)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=CharDataModule(block_size=64, batch_size=4, max_bytes=200_000))
    trainer.save_checkpoint(args.out / "trained.ckpt")  # with LoRA: the adapters alone
    weights = full_state_dict(model)  # a collective: the whole model, gathered on rank 0
    if trainer.is_global_zero:
        print(f"checkpoint: {(args.out / 'trained.ckpt').resolve()}")
        export(args, merge_lora(weights, lora_alpha=model.hparams.lora_alpha, lora_rank=args.lora_rank))
    exit_after_distributed_run()


def merge_lora(weights: dict[str, torch.Tensor], lora_alpha: float, lora_rank: int) -> dict[str, torch.Tensor]:
    """Fold every adapter into its base weight (W + alpha/rank * B A) and drop it: a plain transformers model."""
    merged = {name: tensor for name, tensor in weights.items() if not name.endswith(("lora_a", "lora_b"))}
    for name in weights:
        if name.endswith("lora_a"):
            layer = name[: -len("lora_a")]
            delta = weights[layer + "lora_b"] @ weights[layer + "lora_a"] * (lora_alpha / lora_rank)
            merged[layer + "weight"] = merged[layer + "weight"] + delta
    return merged


def export(args: argparse.Namespace, weights: dict[str, torch.Tensor]) -> None:
    """The trained model as a folder transformers reads (``convert --to hf``), loaded back and run."""
    from transformers import AutoModelForCausalLM

    save_full_checkpoint(args.out / "merged.ckpt", {"state_dict": weights})
    convert(
        args.out / "merged.ckpt",
        args.out / "hf",
        "hf",
        config=args.pretrained / "config.json",
        quiet=True,
        overwrite=True,
    )
    loaded = AutoModelForCausalLM.from_pretrained(args.out / "hf")
    prompt = torch.tensor([list(b"def main(")])
    continuation = loaded.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]
    print(f"exported: {(args.out / 'hf').resolve()}")
    print("continuation:", repr(bytes(continuation.tolist()).decode("utf-8", errors="replace")))


if __name__ == "__main__":
    main()
