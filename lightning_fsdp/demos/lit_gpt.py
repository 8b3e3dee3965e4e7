"""``LitGPT``: the demo GPT as a LightningModule, written so that a sharding strategy can build and shard it.

Three choices make it work under ``FSDPStrategy`` as well as under DDP or a single device:

- The GPT is built in :meth:`LitGPT.configure_model`, not in ``__init__``. Lightning calls that hook under the
  strategy's init context, so the strategy decides where the weights are created (the meta device, the GPU)
  and can shard the model block by block before it ever exists whole in one place.
- Everything that looks at parameters after set-up (optimizer groups, freezing) goes by parameter *name* and
  by the module the parameter is registered on. Sharding keeps names and module structure but replaces each
  parameter by this rank's rows, so shapes then describe the shard, not the parameter.
- Evaluation metrics are torchmetrics objects, whose states are summed over all ranks when they are computed:
  the logged validation perplexity is that of the whole validation set, not of rank 0's part of it.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_fsdp.checkpoint.safe_load import load_torch_file
from lightning_fsdp.demos.corpus import VOCAB_SIZE
from lightning_fsdp.demos.gpt import GPT, GPTConfig

__all__ = ["LitGPT", "freeze_by_prefix", "split_weight_decay", "warmup_cosine"]

Batch = tuple[torch.Tensor, torch.Tensor]


class LitGPT(LightningModule):
    """The byte-level demo GPT (``lightning_fsdp.demos.gpt``) with AdamW, a warm-up/cosine schedule and perplexity.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: width of the residual stream.
        block_size: the longest sequence the model accepts (its position table); data windows must not be longer.
        dropout: dropout probability in attention and MLP.
        bias: whether linear layers and layer norms have biases.
        lr: peak learning rate, reached after the warm-up.
        weight_decay: AdamW weight decay of the weight matrices (see :func:`split_weight_decay`).
        betas: AdamW betas.
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr``.
        min_lr_ratio: the cosine decay ends, at the Trainer's last step, at ``lr * min_lr_ratio``.
        freeze: parameter-name prefixes (relative to the GPT, e.g. ``"wte"``, ``"blocks.0"``) whose parameters
            are frozen (``requires_grad=False``) and left out of the optimizer. The token embedding ``wte`` is tied
            to the output head ``lm_head``: freezing either freezes both.
        pretrained: a full Lightning checkpoint file of a ``LitGPT`` with the same architecture whose weights
            the model starts from (fine-tuning); None to start from random weights. Every rank reads the whole
            file into host memory before sharding, so this is for models that fit there.
        max_new_tokens: bytes :meth:`predict_step` generates after each prompt.
        optimizer: how to build the optimizer from the parameter groups (two: with and without weight decay), named in
            a config by its ``class_path`` (``torch.optim.Adafactor``, ``pytorch_optimizer.Lamb``, ...) with its own
            ``init_args``; None for AdamW with ``lr`` and ``betas``. The schedule scales its learning rate alike.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        freeze: list[str] | None = None,
        pretrained: str | None = None,
        max_new_tokens: int = 32,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head}): each head gets n_embd/n_head")
        if warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                f"warmup_steps must be >= 0 and min_lr_ratio in [0, 1], got {warmup_steps} and {min_lr_ratio}"
            )
        self.save_hyperparameters(ignore=["optimizer"])  # a checkpoint holds plain data, no callable
        self.make_optimizer = optimizer
        self.model: GPT | None = None  # built by configure_model
        # One metric object per stage: validation and test epochs must not share accumulated state.
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_perplexity, self.test_perplexity = Perplexity(), Perplexity()

    def gpt_config(self) -> GPTConfig:
        """The GPT's architecture from the hyperparameters (the vocabulary is bytes: the demo corpus's 256)."""
        hp = self.hparams
        return GPTConfig(
            vocab_size=VOCAB_SIZE,
            block_size=hp.block_size,
            n_layer=hp.n_layer,
            n_head=hp.n_head,
            n_embd=hp.n_embd,
            dropout=hp.dropout,
            bias=hp.bias,
        )

    @override
    def configure_model(self) -> None:
        """Build the GPT (under the strategy's init context), load ``pretrained`` weights, apply ``freeze``.

        Lightning calls this hook at the start of every fit/validate/test/predict, and ``load_from_checkpoint``
        calls it before loading weights; a model that already exists (and may already be sharded) is kept.
        """
        if self.model is not None:
            return
        if self.hparams.pretrained is None:
            model = GPT(self.gpt_config())
        else:
            model = self._load_pretrained(Path(self.hparams.pretrained))
        freeze_by_prefix(model, self.hparams.freeze or [])
        self.model = model

    def _load_pretrained(self, path: Path) -> GPT:
        if path.is_dir():
            raise ValueError(
                f"pretrained={str(path)!r} is a folder (a sharded checkpoint); fine-tuning starts from a full "
                "checkpoint file: save the pre-training run with FSDPStrategy(state_dict_type='full')."
            )
        # Plain data only: a pretrained file usually comes from somewhere else, and unpickling can run its code.
        checkpoint = load_torch_file(
            path,
            trust=False,
            opt_in="torch.load(weights_only=False) yourself, then save just its state_dict",
            mmap=False,
        )
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise ValueError(f"pretrained={str(path)!r} is not a Lightning checkpoint: it has no 'state_dict'.")
        weights = {name.removeprefix("model."): tensor for name, tensor in checkpoint["state_dict"].items()}
        # Built on the CPU whatever the init context says: the weights are read into host memory anyway, and a
        # model on the meta device could only take them by assignment, which would untie lm_head from wte.
        with torch.device("cpu"):
            model = GPT(self.gpt_config())
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as err:
            raise ValueError(
                f"the checkpoint {path} does not fit this LitGPT; give the model the hyperparameters it was "
                f"trained with (stored under 'hyper_parameters' in the checkpoint). {err}"
            ) from None
        return model

    @override
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``, or the mean cross-entropy when ``targets`` is given."""
        if self.model is None:
            raise RuntimeError("LitGPT.configure_model() must run before the model is called (the Trainer does it)")
        return self.model(idx, targets)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self(inputs, targets)
        # This rank's loss, unsynced: averaging it over ranks every step would add a collective for a log line.
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_perplexity, "val")

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_perplexity, "test")

    def _evaluate(self, batch: Batch, loss_metric: MeanMetric, perplexity: Perplexity, stage: str) -> None:
        inputs, targets = batch
        logits = self(inputs).float()  # the metrics' softmax and log in fp32 under any precision
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss_metric.update(loss, weight=targets.numel())  # weighted by tokens: a short last batch counts less
        perplexity.update(logits, targets)
        # Logging the metric objects makes Lightning compute them at epoch end, summed over all ranks.
        self.log(f"{stage}_loss", loss_metric, prog_bar=True)
        self.log(f"{stage}_ppl", perplexity, prog_bar=True)

    @override
    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """The greedy continuation of each window's inputs: ``(batch, max_new_tokens)`` bytes.

        Decode one row with ``bytes(row.tolist()).decode("utf-8", errors="replace")``.
        """
        inputs, _ = batch
        return self.generate(inputs, self.hparams.max_new_tokens)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Append ``max_new_tokens`` greedily chosen tokens to ``idx`` ``(batch, seq)``; returns only the new ones.

        Every call runs the whole model, so under a sharding strategy every rank must generate the same number
        of tokens (each rank's forward joins the same collectives); a fixed count guarantees that.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.hparams.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return idx[:, -max_new_tokens:]

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """The optimizer (AdamW, or ``optimizer``'s) over the trainable parameters in two groups, and a per-step
        warm-up/cosine schedule.

        Called after the strategy has sharded the model, so the optimizer holds (and steps) this rank's shards.
        """
        if self.model is None:
            raise RuntimeError("LitGPT.configure_model() must run before configure_optimizers()")
        decay, no_decay = split_weight_decay(self.model)
        groups = [
            {"params": list(decay.values()), "weight_decay": self.hparams.weight_decay},
            {"params": list(no_decay.values()), "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
        if self.make_optimizer is not None:
            optimizer = self.make_optimizer(groups)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        schedule = partial(
            warmup_cosine,
            warmup_steps=self.hparams.warmup_steps,
            total_steps=self.trainer.estimated_stepping_batches,
            min_lr_ratio=self.hparams.min_lr_ratio,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store ``pretrained=None``: the checkpoint's own weights already include what that file contributed.

        Otherwise ``load_from_checkpoint`` would read the old file again (through ``configure_model``) only to
        overwrite its weights, and fail once that file has moved.
        """
        hparams = checkpoint.get(self.CHECKPOINT_HYPER_PARAMS_KEY)
        if isinstance(hparams, dict) and "pretrained" in hparams:
            hparams["pretrained"] = None


def freeze_by_prefix(model: nn.Module, prefixes: list[str]) -> None:
    """Set ``requires_grad=False`` on every parameter whose name is a prefix or starts with ``prefix + "."``.

    Names are matched with duplicates kept, so a tied parameter is found under each of its names
    (``lm_head.weight`` as well as ``wte.weight``). A prefix that matches nothing is an error, not a silent
    no-op, and so is freezing everything.
    """
    named = list(model.named_parameters(remove_duplicate=False))
    for prefix in prefixes:
        matched = [param for name, param in named if name == prefix or name.startswith(prefix + ".")]
        if not matched:
            tops = sorted({name.split(".")[0] for name, _ in named})
            raise ValueError(
                f"freeze prefix {prefix!r} matches no parameter of {type(model).__name__}; prefixes are parameter "
                f"names or their leading dotted parts, starting with one of {tops} (e.g. 'blocks.0')."
            )
        for param in matched:
            param.requires_grad_(False)
    if prefixes and not any(param.requires_grad for _, param in named):
        raise ValueError(f"freeze={prefixes} freezes every parameter, which leaves nothing to train.")


def split_weight_decay(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """The trainable parameters by name, split into those that get weight decay and those that do not.

    Decayed: the ``weight`` of every ``nn.Linear``, the matrices that multiply activations, including the token
    embedding, since it is tied to ``lm_head.weight`` (as in GPT-2). Not decayed: biases, layer-norm
    parameters (decay would pull the gains toward zero, not toward their neutral 1) and the position embedding,
    an additive table that plays the role of a bias. The decision uses the module a parameter is registered on
    and the attribute name, never the shape: after sharding a shape is that of this rank's rows.
    A parameter registered on several modules (a tied one) is decayed if any of them decays it.
    """
    decayed_ids = {
        id(param)
        for module in model.modules()
        if isinstance(module, nn.Linear)
        for attr, param in module.named_parameters(recurse=False)
        if attr == "weight"
    }
    decay: dict[str, nn.Parameter] = {}
    no_decay: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if id(param) in decayed_ids else no_decay)[name] = param
    return decay, no_decay


def warmup_cosine(step: int, warmup_steps: int, total_steps: float, min_lr_ratio: float) -> float:
    """The learning-rate multiplier before optimizer step ``step`` (0-based).

    Linear warm-up from ``1 / warmup_steps`` to 1 over the first ``warmup_steps`` steps, then a half cosine
    down to ``min_lr_ratio`` at ``total_steps``, held there afterwards. An infinite ``total_steps`` (a Trainer
    without a step or epoch limit) keeps the peak rate after the warm-up.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1.0, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
