"""The opt-in meta-device build is exact: tied parameters get the init an eager build gives them (whichever owner
created them), a ``load_state_dict`` into meta parameters is refused instead of silently doing nothing, and a tensor
no initialiser writes (a buffer computed at ``__init__``, say) is refused or named, never left as garbage.

In-process: materialization is a plain function of the module tree; the strategy's contexts need no process group.
A ``param_init_fn`` given for a model with nothing on the meta device is named in a warning (a one-rank Trainer run).
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp import FSDPStrategy, fully_shard, meta_build, summon_full_params
from lightning_fsdp.engine.init.materialize import check_initializable, materialize, track_meta_build
from tests.distributed import run_distributed


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


class Rotary(nn.Module):
    """A rotary embedding's buffer computed in ``__init__`` (non-persistent, as in Llama), a projection, a persistent
    step counter and a trainable scale; ``computes_in_reset`` says whether ``reset_parameters`` recomputes the
    buffer (the fix a meta build needs) or only initialises the scale (the usual oversight)."""

    def __init__(self, computes_in_reset: bool, dim: int = 8) -> None:
        super().__init__()
        self.computes_in_reset = computes_in_reset
        self.dim = dim
        self.scale = nn.Parameter(torch.rand(dim))  # before the child, as reset_parameters() runs before the child's
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.register_buffer("mask", self._mask(), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, self.dim, 2, device=self.scale.device).float() / self.dim)

    def _mask(self) -> torch.Tensor:
        return torch.ones(self.dim, self.dim, dtype=torch.bool, device=self.scale.device).tril()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        self.steps.zero_()
        if self.computes_in_reset:
            self.inv_freq.copy_(self._inv_freq())
            self.mask.copy_(self._mask())


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            owners.setdefault(id(param), []).append((module, name))
    return owners


def build_and_materialize(creator: str, tracked: bool) -> TiedLM:
    torch.manual_seed(0)
    with torch.device("meta"), track_meta_build() if tracked else nullcontext():
        model = TiedLM(creator)
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"), None, _owners(model), lambda meta, real: None)
    return model


def test_a_buffer_computed_at_init_and_not_by_the_initialiser_is_refused_before_anything_is_materialised() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary(computes_in_reset=False))
    torch.manual_seed(0)
    rng = torch.random.get_rng_state()
    with pytest.raises(
        ValueError,
        match=r"module '1' \(Rotary\) .* non-persistent buffer\(s\) inv_freq, mask was lost, and "
        r"its reset_parameters\(\) does not set it.*Nothing was materialised",
    ):
        check_initializable(model, None)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers())), "the refusal materialised something"
    assert torch.equal(torch.random.get_rng_state(), rng), "the check's trial run moved the random stream"
    with pytest.raises(ValueError, match=r"inv_freq, mask was lost, and param_init_fn does not set it"):
        check_initializable(model, lambda module: None)


def test_a_buffer_the_initialiser_computes_gets_the_eager_value() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), Rotary(computes_in_reset=True))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary(computes_in_reset=True))
    torch.manual_seed(0)
    check_initializable(model, None)  # runs Rotary's initialiser on a scratch copy: must not shift what follows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor was written: nothing to warn about
        materialize(model, torch.device("cpu"), None, _owners(model), lambda meta, real: None)
    for name, tensor in eager.state_dict(keep_vars=True).items():
        torch.testing.assert_close(model.state_dict(keep_vars=True)[name], tensor, rtol=0, atol=0, msg=name)
    for name in ("inv_freq", "mask"):  # non-persistent: not in the state dicts compared above
        assert torch.equal(getattr(model[1], name), getattr(eager[1], name)), name


def test_tensors_an_initialiser_leaves_unwritten_are_named_and_hold_nan() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary(computes_in_reset=True))

    def init_weights_only(module: nn.Module) -> None:  # forgets the Linear's bias and the step counter
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)
        if isinstance(module, Rotary):
            module.inv_freq.copy_(module._inv_freq())
            module.mask.copy_(module._mask())
            nn.init.zeros_(module.scale)

    check_initializable(model, init_weights_only)  # the non-persistent buffer is set: no refusal
    with pytest.warns(
        UserWarning,
        match=r"^3 tensor\(s\) .* written by neither .*: 0\.bias, 1\.steps, 1\.proj\.bias\. "
        r"They hold NaN \(integers: their largest value\) until a checkpoint is loaded",
    ):
        materialize(model, torch.device("cpu"), init_weights_only, _owners(model), lambda meta, real: None)
    assert bool(torch.isnan(model[0].bias).all()) and bool(torch.isnan(model[1].proj.bias).all())
    assert int(model[1].steps) == torch.iinfo(torch.long).max
    assert torch.equal(model[0].weight, torch.ones(8, 8)) and torch.equal(model[1].scale, torch.zeros(8))


class HoldsALock(nn.Module):
    """A buffer computed at ``__init__`` that ``reset_parameters`` forgets, in a module that cannot be deep-copied
    (it holds a lock): the trial on a scratch copy cannot run, so the real initialisation must judge it."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        pass


def test_a_lost_buffer_the_trial_cannot_judge_is_named_as_never_coming_from_a_checkpoint() -> None:
    with torch.device("meta"):
        model = HoldsALock()
    check_initializable(model, None)  # deepcopy raises (a lock): left to the real initialisation
    with pytest.warns(UserWarning, match=r"^1 non-persistent buffer\(s\) .*: table\. No checkpoint holds them"):
        materialize(model, torch.device("cpu"), None, _owners(model), lambda meta, real: None)
    assert bool(torch.isnan(model.table).all())


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


def _param_init_fn_runs(rank: int, world_size: int, out: str) -> None:
    """One-rank Trainer runs with a counting ``param_init_fn``: eagerly built (not called, one warning) and with
    ``empty_init=True`` (called for every materialised module, no warning)."""
    from tests.scripts.strategy_common import LitGPT, make_trainer, token_loader

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", NODE_RANK="0")
    results = {}
    for empty_init in (False, True):
        initialised: list[str] = []

        def count(module: nn.Module, initialised: list[str] = initialised) -> None:
            initialised.append(type(module).__name__)
            module.reset_parameters()

        strategy = FSDPStrategy(param_init_fn=count, empty_init=empty_init)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(strategy, devices=1, max_steps=1).fit(LitGPT(in_configure_model=True), token_loader(2, 2))
        unused = [str(w.message) for w in caught if "param_init_fn is not called" in str(w.message)]
        results[empty_init] = {"initialised": initialised, "warnings": unused}
    torch.save(results, Path(out) / "param_init_fn.pt")


def test_param_init_fn_with_nothing_on_meta_is_named_in_a_warning(tmp_path: Path) -> None:
    run_distributed(_param_init_fn_runs, 1, str(tmp_path), timeout=300)
    results = torch.load(tmp_path / "param_init_fn.pt", weights_only=True)
    eager, deferred = results[False], results[True]
    assert eager["initialised"] == []
    assert len(eager["warnings"]) == 1
    message = eager["warnings"][0]
    for fragment in ("no parameter or buffer of LitGPT is on the meta device", "empty_init=True", "configure_model"):
        assert fragment in message, message
    assert {"Linear", "LayerNorm"} <= set(deferred["initialised"])
    assert deferred["warnings"] == []


def _meta_build_rank(rank: int, world_size: int) -> None:
    for creator in ("head", "embedding"):
        torch.manual_seed(0)
        eager = TiedLM(creator)
        torch.manual_seed(0)
        with meta_build():
            model = TiedLM(creator)
        assert all(p.is_meta for p in model.parameters())
        fully_shard(model)
        with summon_full_params(model):
            built = {name: value.clone() for name, value in model.state_dict().items()}
        for name, reference in eager.state_dict().items():
            torch.testing.assert_close(built[name], reference, rtol=0, atol=0, msg=f"{creator}: {name}")


def test_meta_build_gives_the_engine_alone_the_eager_values() -> None:
    """``lightning_fsdp.meta_build()``: the recorded build for a model handed to ``fully_shard`` directly (no Trainer
    or Fabric), exact on both ranks, where a plain ``torch.device("meta")`` is not (the test above)."""
    run_distributed(_meta_build_rank, 2, timeout=120)
