"""Lightning's ``FSDPStrategy`` arguments, and the torch-FSDP keyword arguments it forwards, onto our engine's.

Lightning's strategy passes its ``**kwargs`` straight to torch's ``FullyShardedDataParallel``. Every one of those
keywords has a meaning for our engine too, so :class:`~lightning_fsdp.FSDPStrategy` takes each as a named
argument (which LightningCLI configs need) and this module reads the forms torch and Lightning accept for them.
A keyword outside that set is refused here with the list of what is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch import nn

# Torch FSDP's constructor keywords that FSDPStrategy takes under the same name and meaning.
TORCH_FSDP_KEYWORDS = (
    "process_group",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "sync_module_states",
    "param_init_fn",
    "device_id",
    "use_orig_params",
    "ignored_modules",
    "ignored_states",
)
# What each keyword Lightning's strategy keeps in ``strategy.kwargs`` defaults to when it is not given: the defaults of
# FSDPStrategy's and FabricFSDPStrategy's signatures (a test holds them equal).
TORCH_FSDP_DEFAULTS: dict[str, Any] = {
    "auto_wrap_policy": None,
    "device_mesh": None,
    "process_group": None,
    "backward_prefetch": "BACKWARD_PRE",
    "forward_prefetch": None,
    "limit_all_gathers": True,
    "sync_module_states": False,
    "param_init_fn": None,
    "device_id": None,
    "ignored_modules": None,
    "ignored_states": None,
}
# Names users carry over from older torch-FSDP code that FSDPStrategy does not take, with what to pass instead.
_NO_MEANING = {
    "policy": "it is torch's old name for auto_wrap_policy; pass auto_wrap_policy instead",
    "auto_wrap": "pass auto_wrap_policy instead",
}


def refuse_unknown_keywords(kwargs: dict[str, Any]) -> None:
    """Every keyword FSDPStrategy does not name is refused, with what to use instead."""
    if not kwargs:
        return
    name = next(iter(kwargs))
    reason = _NO_MEANING.get(name, "neither Lightning's FSDPStrategy nor torch's FullyShardedDataParallel takes it")
    raise ValueError(
        f"FSDPStrategy got the keyword argument {name}={kwargs[name]!r}, which has no meaning for lightning_fsdp "
        f"({reason}); the torch-FSDP keywords it accepts are {', '.join(TORCH_FSDP_KEYWORDS)}."
    )


def activation_checkpointing_alias(activation_checkpointing: object, policy: object) -> object:
    """The deprecated ``activation_checkpointing`` (classes) as ``activation_checkpointing_policy``, with Lightning's
    deprecation warning; both at once are refused as Lightning refuses them."""
    if activation_checkpointing is None:
        return policy
    if policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    classes = (
        tuple(activation_checkpointing)
        if isinstance(activation_checkpointing, list | tuple | set)
        else (activation_checkpointing,)
    )
    rank_zero_deprecation(
        f"`FSDPStrategy(activation_checkpointing={activation_checkpointing})` is deprecated, use "
        f"`FSDPStrategy(activation_checkpointing_policy={set(classes)})` instead."
    )
    return set(classes)


def split_ignored(
    ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[nn.Module | nn.Parameter] | None
) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """torch's ``ignored_modules`` and ``ignored_states`` (modules or parameters, not both) as the engine's two
    lists: modules left whole, parameters left whole."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "ignored_modules and ignored_states were both given; torch's FSDP takes one of them, so pass the modules "
            "(and parameters) through ignored_states alone."
        )
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    for item in ignored_modules or ignored_states or ():
        if isinstance(item, nn.Parameter):
            params.append(item)
        elif isinstance(item, nn.Module):
            modules.append(item)
        else:
            raise ValueError(
                f"ignored_states holds a {type(item).__name__}; list nn.Module instances or nn.Parameter objects."
            )
    if ignored_modules is not None and params:
        raise ValueError("ignored_modules holds parameters; pass parameters through ignored_states instead.")
    return modules, params


class TorchFSDPKeywords(Mapping[str, Any]):
    """``strategy.kwargs`` as Lightning's ``FSDPStrategy`` fills it: the torch-FSDP keywords the user gave (as given),
    ``auto_wrap_policy`` and ``device_mesh`` when set, and ``use_orig_params`` always.

    Read-only: code written for Lightning's strategy reads it (``strategy.kwargs["use_orig_params"]``); the strategy
    itself runs on its attributes of the same names, so a write here would change nothing and is refused instead.
    """

    def __init__(self, given: Mapping[str, Any]) -> None:
        self._keywords = dict(given)

    def __getitem__(self, name: str) -> Any:
        return self._keywords[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keywords)

    def __len__(self) -> int:
        return len(self._keywords)

    def __setitem__(self, name: str, value: Any) -> None:
        raise TypeError(
            f"strategy.kwargs is read-only; pass {name}= to the strategy's constructor instead of setting it here."
        )

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"strategy.kwargs is read-only; construct the strategy without {name}= instead.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._keywords!r})"


def torch_fsdp_keywords(values: Mapping[str, Any], use_orig_params: bool) -> TorchFSDPKeywords:
    """The keywords of ``values`` (as given to the constructor) that differ from ``TORCH_FSDP_DEFAULTS``, plus
    ``use_orig_params``: what Lightning's strategy holds, since it keeps only the keywords it was passed."""
    given = {name: value for name, value in values.items() if not _is_default(value, TORCH_FSDP_DEFAULTS[name])}
    return TorchFSDPKeywords({**given, "use_orig_params": use_orig_params})


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)
