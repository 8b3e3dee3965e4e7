"""A Hugging Face causal language model as a LightningModule, fine-tuned on the demo corpus' bytes.

The recipe, and what each way of loading the pretrained weights costs in host memory per rank:

- ``load="rows"`` (the default): ``configure_model`` builds the model from its ``config.json`` alone (random weights;
  under ``trainer.init_module(empty_init=True)`` on the meta device, costing nothing), the strategy shards it, and
  ``on_fit_start`` reads each rank's rows of every tensor from the safetensors files with ``load_pretrained``:
  about one tensor beyond the shards.
- ``load="from_pretrained"``: ``configure_model`` calls ``from_pretrained``, so every rank holds the whole model
  until the strategy shards it. Simplest, and fine while the model fits each rank's host memory.

``lora_rank > 0`` adds LoRA adapters to the ``lora_targets`` layers and freezes the rest; with
``FSDPStrategy(save_trainable_only=True)`` checkpoints hold the adapters alone. ``adapters="peft"`` wraps the model with
peft's ``get_peft_model`` instead of ``lightning_fsdp.demos.lora`` (peft renames the base weights, so it needs
``load="from_pretrained"``). transformers is imported only when the model is built (not a dependency of lightning_fsdp).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from typing_extensions import override

from lightning_fsdp.checkpoint.pretrained import load_pretrained
from lightning_fsdp.demos.lora import add_lora

# The demo datamodule's (inputs, targets) pairs, or a plain tensor of token ids: the model shifts labels itself.
Batch = tuple[torch.Tensor, torch.Tensor] | torch.Tensor


def _token_ids(batch: Batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class HFCausalLM(LightningModule):
    """Fine-tunes the transformers model saved at ``pretrained`` (a ``save_pretrained`` folder).

    Args:
        pretrained: a folder with ``config.json`` and safetensors weights (``model.safetensors`` or an index).
        load: ``"rows"`` or ``"from_pretrained"``, see the module docstring.
        lora_rank: 0 trains every parameter; above 0, LoRA adapters of that rank on ``lora_targets`` only.
        lora_targets: names of the ``nn.Linear`` layers to adapt (matched at the end of the module name).
        lora_alpha: LoRA's scale numerator (the update is scaled by ``alpha / rank``).
        adapters: whose LoRA, ``"builtin"`` or ``"peft"`` (see the module docstring).
        lr, weight_decay: AdamW's, over the trainable parameters.
    """

    def __init__(
        self,
        pretrained: str,
        load: Literal["rows", "from_pretrained"] = "rows",
        lora_rank: int = 0,
        lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
        lora_alpha: float = 16.0,
        adapters: Literal["builtin", "peft"] = "builtin",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if load not in ("rows", "from_pretrained"):
            raise ValueError(f"load={load!r}: use 'rows' or 'from_pretrained'.")
        if adapters not in ("builtin", "peft"):
            raise ValueError(f"adapters={adapters!r}: use 'builtin' or 'peft'.")
        if adapters == "peft" and lora_rank > 0 and load != "from_pretrained":
            raise ValueError(
                "adapters='peft' renames the base model's weights, so the pretrained rows cannot be read after "
                "sharding; use load='from_pretrained' with it."
            )
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.hparams.load == "from_pretrained":
            model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.pretrained))
        if self.hparams.lora_rank > 0 and self.hparams.adapters == "peft":
            from peft import LoraConfig, get_peft_model

            adapted = LoraConfig(
                r=self.hparams.lora_rank,
                lora_alpha=self.hparams.lora_alpha,
                target_modules=list(self.hparams.lora_targets),
                lora_dropout=0.0,
            )
            model = get_peft_model(model, adapted)
        elif self.hparams.lora_rank > 0:
            add_lora(model, self.hparams.lora_targets, self.hparams.lora_rank, self.hparams.lora_alpha)
        self.model = model

    @override
    def on_fit_start(self) -> None:
        """Read the pretrained rows into the (now sharded) model; a checkpoint being resumed is restored after this."""
        if self.hparams.load != "rows":
            return
        result = load_pretrained(self.model, self.hparams.pretrained, strict=False)
        missing = [name for name in result.missing if not name.endswith(("lora_a", "lora_b"))]
        if missing or result.unexpected:
            raise ValueError(
                f"the weights at {self.hparams.pretrained} do not fit the model built from its config: missing "
                f"{missing[:8]}, unexpected {result.unexpected[:8]}."
            )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, labels=labels)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        inputs = _token_ids(batch)
        loss = self(inputs, labels=inputs).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        inputs = _token_ids(batch)
        self.log("val_loss", self(inputs, labels=inputs).loss, sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [param for param in self.parameters() if param.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
