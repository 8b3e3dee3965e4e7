"""LitGPT 0.5.13's own commands, run on the ranks of a test the way their users run them, on CPU.

A LitGPT user swaps Lightning's ``FSDPStrategy`` for ours by name: the scripts take no strategy argument and build
``FSDPStrategy(...)`` themselves whenever more than one device is asked for. :func:`run_litgpt` does that swap in the
script's module and then runs the command line (``litgpt pretrain ...``) through LitGPT's own entry point, so that
what the scripts record from ``sys.argv`` (``hyperparameters.yaml``, which ``merge_lora`` reads) is what a user gets.
The control swaps in Lightning's DDP instead (``STRATEGIES``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from jsonargparse import CLI
from lightning.fabric.strategies import DDPStrategy
from litgpt.config import Config
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Dataset

import lightning_fsdp

TINY = dict(
    name="tiny-llama-test",
    block_size=64,
    vocab_size=24,
    padded_vocab_size=24,
    n_layer=2,
    n_head=2,
    n_query_groups=1,
    n_embd=16,
    rotary_percentage=1.0,
    parallel_residual=False,
    bias=False,
    norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP",
    intermediate_size=24,
)
WORDS = ["<unk>", "<s>", "</s>", *"the a of to and in is it that for on with as was be by this are or an at".split()]
# The script of each command, whose ``FSDPStrategy`` name the swap replaces.
SCRIPTS = {
    "pretrain": "litgpt.pretrain",
    "finetune_full": "litgpt.finetune.full",
    "finetune_lora_legacy": "litgpt.finetune.lora_legacy",
}


class InitialisingDDPStrategy(DDPStrategy):
    """Lightning's DDP, building every model for real. Under ``empty_init=True`` plain DDP leaves the weights as
    uninitialised memory: ``pretrain`` then initialises every parameter itself (its non-FSDP branch), but the LoRA
    script, which asks for ``empty_init`` on more than one device, expects FSDP to initialise its adapters as the
    model materialises; this control initialises them as the eager build does."""

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        return super().module_init_context(empty_init=False)


def _in_place_of_fsdp(strategy: type[DDPStrategy]) -> type:
    class DDPInPlaceOfFSDP:
        """What the script builds as its FSDPStrategy is DDP, and nothing is an instance of this class, so the
        script's ``isinstance(strategy, FSDPStrategy)`` branches take their non-FSDP side."""

        def __new__(cls, **kwargs: object) -> DDPStrategy:
            return strategy()

    return DDPInPlaceOfFSDP


class RandomTokens(Dataset):
    def __init__(self, n: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, TINY["vocab_size"], (n, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class ResumableLoader(DataLoader):
    """A DataLoader that resumes where it stopped, as LitGPT's own pretraining loader (litdata's
    ``StreamingDataLoader``) does: Fabric saves its ``state_dict`` with the run and restores it on resume."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.consumed, self.skip = 0, 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.consumed = index + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["consumed"]


class Tokens(DataModule):
    """Pretraining data without a download: fixed random token rows (``--data tests.scripts.litgpt_scripts.Tokens``)."""

    def connect(self, tokenizer: object = None, batch_size: int = 1, max_seq_length: int | None = None, **_: object):
        self.batch_size, self.length = batch_size, max_seq_length

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(RandomTokens(64, self.length, 0), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(8, self.length, 1), batch_size=self.batch_size)


STRATEGIES = {
    "ours": lightning_fsdp.FabricFSDPStrategy,
    "ddp": _in_place_of_fsdp(DDPStrategy),
    "ddp, initialising": _in_place_of_fsdp(InitialisingDDPStrategy),
}


def write_base_checkpoint(folder: Path) -> None:
    """What ``litgpt download`` leaves, offline: a seeded tiny model, its config, a word-level tokenizer, and
    instruction data for the fine-tuning commands."""
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    config = Config(**TINY)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    save_config(config, folder)
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps({**special, "tokenizer_class": "PreTrainedTokenizerFast"}))
    words = WORDS[3:]
    records = [
        {"instruction": " ".join(words[(i + j) % len(words)] for j in range(3)), "input": "", "output": words[i % 7]}
        for i in range(16)
    ]
    (folder / "data.json").write_text(json.dumps(records))


def run_litgpt(rank: int, world_size: int, strategy: str, argv: list[str]) -> None:
    """Run ``litgpt <argv>`` on this rank with the script's FSDPStrategy swapped for ``STRATEGIES[strategy]``."""
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world_size)})
    script = importlib.import_module(SCRIPTS[argv[0]])
    script.FSDPStrategy = STRATEGIES[strategy]
    if argv[0] == "finetune_lora_legacy":  # not a LitGPT subcommand: run as ``python lora_legacy.py ...`` would
        sys.argv = [script.__file__, *argv[1:]]
        CLI(script.setup)
    else:
        from litgpt.__main__ import main

        sys.argv = ["litgpt", *argv]
        main()
