"""A seeded meta build gets exactly the eager build's values, whatever order ``__init__`` initialises in: the init
program recorded under ``track_meta_build`` is replayed at materialisation (see [Note: replaying the eager build's
init] in lightning_fsdp/engine/init/program.py). What cannot be replayed falls back, saying why.

In-process: materialisation is a plain function of the module tree; the sharded path is in
test_engine_deferred_init.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import GPT, GPTConfig
from lightning_fsdp.engine.init.materialize import check_initializable, materialize, track_meta_build
from tests.init_models import LoRAStack, NanoGPT
from tests.test_meta_build import _owners


def _materialize(model: nn.Module) -> None:
    check_initializable(model, None)
    materialize(model, torch.device("cpu"), None, _owners(model), lambda meta, real: None)


def _eager_and_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The eager build and the materialised meta build from seed 0, and the next draw after each."""
    torch.manual_seed(0)
    eager = build()
    after_eager = torch.rand(4)
    torch.manual_seed(1)  # recording draws nothing: the seed that counts is the one at materialisation
    with torch.device("meta"), track_meta_build():
        model = build()
    torch.manual_seed(0)
    _materialize(model)
    return eager, model, after_eager, torch.rand(4)


def _assert_same_tensors(model: nn.Module, eager: nn.Module) -> None:
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    reference = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}  # non-persistent buffers too
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), f"{name} differs from the eager build"


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(LoRAStack, id="lora-linear"),
        pytest.param(NanoGPT, id="apply-init-weights-tied-head"),
        pytest.param(lambda: GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)), id="demo"),
    ],
)
def test_a_seeded_meta_build_equals_the_eager_build_bit_for_bit(build: Callable[[], nn.Module]) -> None:
    eager, model, after_eager, after_meta = _eager_and_meta(build)
    _assert_same_tensors(model, eager)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(after_meta, after_eager), "the random stream after setup is not where the eager build left it"


def test_an_apply_style_model_gets_its_sweep_not_the_modules_defaults() -> None:
    """The issue's symptom: without the replay the embedding kept nn.Embedding's normal(0, 1)."""
    eager, model, _, _ = _eager_and_meta(NanoGPT)
    assert model.wte.weight is model.lm_head.weight
    assert model.wte.weight.std() < 0.05 and model.blocks[0].c_attn.bias.abs().max() == 0
    inv_freq = model.blocks[0].rotary.inv_freq  # computed in __init__ only, from torch.arange: replayed too
    assert torch.equal(inv_freq, eager.blocks[0].rotary.inv_freq) and not bool(torch.isnan(inv_freq).any())


class Assorted(nn.Module):
    """Writes the replay must follow: through ``.data``, into part of a tensor, an initialiser that skips meta
    tensors by hand (orthogonal_), a value computed from another meta tensor, a real tensor copied in, a buffer
    derived from a parameter, a tensor under the default dtype of the build, tensors made from Python data, and an
    in-place op mixing two meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 4))
        self.a.data.normal_()
        self.a.data[0].fill_(3.0)
        self.b = nn.Parameter(torch.empty(4, 4))
        nn.init.orthogonal_(self.b)
        self.c = nn.Parameter(torch.randn(4) * 2 + 1)
        self.d = nn.Parameter(torch.empty(3))
        with torch.no_grad():
            self.d.copy_(torch.tensor([1.0, 2.0, 3.0], device="cpu"))
        self.register_buffer("b_norm", self.b.detach().norm(dim=1))
        build_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as a precision plugin's init context does
        self.e = nn.Parameter(torch.rand(5))
        torch.set_default_dtype(build_dtype)
        self.f = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))  # Python data: no aten op shows its values
        self.register_buffer("pairs", self.f.new_tensor([[0, 1], [1, 0]], dtype=torch.long))
        with torch.no_grad():
            self.f.mul_(self.c[:3])


def test_writes_through_aliases_views_and_computed_values_are_replayed() -> None:
    eager, model, after_eager, after_meta = _eager_and_meta(Assorted)
    _assert_same_tensors(model, eager)
    assert torch.equal(after_meta, after_eager)


class ResizesOnMeta(nn.Module):
    """A build the recording cannot express (a storage resized on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        scratch = torch.empty(2)
        scratch.resize_(8)


def test_what_cannot_be_replayed_falls_back_to_each_modules_initialiser_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    eager = ResizesOnMeta()
    with torch.device("meta"), track_meta_build():
        model = ResizesOnMeta()
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lightning_fsdp.engine.init.materialize"):
        _materialize(model)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "cannot be replayed (aten.resize_.default changes a meta tensor's storage)" in caplog.records[0].message
    _assert_same_tensors(model, eager)  # nn.Linear's reset_parameters: the same values here


def test_a_model_put_on_the_meta_device_by_hand_is_initialised_module_by_module(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a recording the eager values hold only for modules that initialise their own tensors in
    reset_parameters, in module order: LitGPT's LoRALinear initialises its own parameters after its child's."""
    torch.manual_seed(0)
    eager = LoRAStack()
    with torch.device("meta"):
        model = LoRAStack()
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lightning_fsdp.engine.init.materialize"):
        _materialize(model)
    assert "module 'layers.0' was put on the meta device outside track_meta_build" in caplog.text
    assert not torch.equal(model.layers[0].lora_A, eager.layers[0].lora_A), "the control shows nothing"


class NeverWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.empty(4), persistent=False)


def test_a_non_persistent_buffer_nothing_writes_is_refused_before_anything_is_materialised() -> None:
    with torch.device("meta"), track_meta_build():
        model = NeverWritten()
    with pytest.raises(ValueError, match=r"module '<?NeverWritten'? .* table, which nothing in its build writes"):
        check_initializable(model, None)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def test_the_strategies_empty_init_records_the_build() -> None:
    torch.manual_seed(0)
    eager = LoRAStack()
    trainer = L.Trainer(strategy=FSDPStrategy(), accelerator="cpu", devices=2, logger=False)
    for context in (FSDPStrategy(empty_init=True).model_sharded_context(), trainer.init_module(empty_init=True)):
        with context:
            model = LoRAStack()
        torch.manual_seed(0)
        _materialize(model)
        _assert_same_tensors(model, eager)


def test_a_param_init_fn_still_decides() -> None:
    with torch.device("meta"), track_meta_build():
        model = LoRAStack()
    ones = lambda m: [nn.init.ones_(p) for p in m.parameters(recurse=False)]  # noqa: E731
    check_initializable(model, ones)
    materialize(model, torch.device("cpu"), ones, _owners(model), lambda meta, real: None)
    assert all(bool((p == 1).all()) for p in model.parameters())


def _init_halves(module: nn.Linear) -> None:
    nn.init.constant_(module.weight, 0.5)
    nn.init.zeros_(module.bias)


def test_a_reset_parameters_set_after_the_build_is_what_initialises(caplog: pytest.LogCaptureFixture) -> None:
    """LitGPT's pretrain script sets each module's reset_parameters after the meta build and leaves calling them to
    FSDP's materialisation (its eager branch calls them itself): the recording cannot know them, so they run."""
    with torch.device("meta"), track_meta_build():
        model = LoRAStack()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters = partial(_init_halves, module)  # bound to the module, as LitGPT does
    with caplog.at_level(logging.INFO, logger="lightning_fsdp.engine.init.materialize"):
        check_initializable(model, None)
        materialize(model, torch.device("cpu"), None, _owners(model), lambda meta, real: None)
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # what LitGPT asks for: nothing to warn about
    assert "module 'layers.0.linear' had its reset_parameters replaced on the instance" in caplog.text
    assert all(bool((layer.linear.weight == 0.5).all()) for layer in model.layers)


def test_a_transformers_model_which_skips_its_init_on_meta_is_not_silently_given_module_defaults() -> None:
    from tests.test_hf_models import FAMILIES

    with torch.device("meta"), track_meta_build():
        model = FAMILIES["llama"].build(seed=0)
    with pytest.raises(ValueError, match=r"\(LlamaRMSNorm\) was built on the meta device but has no reset_parameters"):
        check_initializable(model, None)
