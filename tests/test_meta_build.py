"""The opt-in meta-device build is exact: tied parameters get the init an eager build gives them (whichever owner
created them), and a ``load_state_dict`` into meta parameters is refused instead of silently doing nothing.

In-process: materialization is a plain function of the module tree; the strategy's contexts need no process group.
"""

from __future__ import annotations

from contextlib import nullcontext

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.engine.deferred_init import materialize, track_meta_build


class TiedLM(nn.Module):
    """A language model head tied to its embedding, either way round: ``creator="head"`` is nanoGPT's
    ``wte.weight = lm_head.weight`` (the head created the tensor), ``"embedding"`` is Hugging Face's
    ``lm_head.weight = wte.weight``."""

    def __init__(self, creator: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)  # normal(0, 1): a head initialised like this starts at a huge loss
        self.norm = nn.LayerNorm(6)
        self.mlp = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=True)
        if creator == "head":
            self.wte.weight = self.lm_head.weight
        else:
            self.lm_head.weight = self.wte.weight


def build_and_materialize(creator: str, tracked: bool) -> TiedLM:
    torch.manual_seed(0)
    with torch.device("meta"), track_meta_build() if tracked else nullcontext():
        model = TiedLM(creator)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            owners.setdefault(id(param), []).append((module, name))
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"), None, owners, lambda meta, real: None)
    return model


@pytest.mark.parametrize("creator", ["head", "embedding"])
def test_a_tied_parameter_gets_its_eager_init(creator: str) -> None:
    torch.manual_seed(0)
    eager = TiedLM(creator)
    built = build_and_materialize(creator, tracked=True)
    assert built.wte.weight is built.lm_head.weight  # the tie survives
    assert not any(t.is_meta for t in (*built.parameters(), *built.buffers()))
    for (name, ours), (_, reference) in zip(built.state_dict().items(), eager.state_dict().items(), strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, msg=f"{creator}: {name}")


def test_without_a_record_the_first_owner_initialises_a_tie() -> None:
    """A model put on the meta device by the user's own ``torch.device("meta")`` carries no creator record; the
    control shows the record is what made nanoGPT's tie exact (its head's init, not the embedding's)."""
    built = build_and_materialize("head", tracked=False)
    assert built.lm_head.weight.std() > 0.5  # nn.Embedding's normal(0, 1), where the eager build has Linear's init
    torch.manual_seed(0)
    assert TiedLM("head").lm_head.weight.std() < 0.5


def test_loading_a_state_dict_into_meta_parameters_is_refused() -> None:
    for context in (
        FSDPStrategy(empty_init=True).model_sharded_context(),  # configure_model with empty_init=True
        L.Trainer(strategy=FSDPStrategy(), accelerator="cpu", devices=2, logger=False).init_module(empty_init=True),
    ):
        with context:
            module = nn.Linear(4, 3)
        assert module.weight.is_meta
        pretrained = nn.Linear(4, 3).state_dict()  # fresh: torch records assign=True in a state dict's metadata
        with pytest.raises(RuntimeError, match=r"load_state_dict into Linear\.weight would do nothing.*assign=True"):
            module.load_state_dict(pretrained)
        module.load_state_dict(pretrained, assign=True)  # replaces the meta tensors: allowed
        torch.testing.assert_close(module.weight, pretrained["weight"])


def test_configure_model_runs_on_the_real_device_by_default() -> None:
    with FSDPStrategy().model_sharded_context():
        module = nn.Linear(4, 3)
        module.weight.data.fill_(2.0)  # a custom init, kept
    assert module.weight.device.type == "cpu"
    assert bool((module.weight == 2.0).all())
