"""The package's layout holds: no import circle between its files, the engine free of Lightning, fabric/ free of
trainer/, no path outside the repository cited, and the strategy arguments defined once yet visible to LightningCLI in
both strategies.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy
from lightning_fsdp.adapter.strategy_arguments import SHARED_ARGUMENTS

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fsdp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its text (lazy imports inside functions too)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # ``from package import submodule`` names the submodule; ``from module import name``, the module.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_file_of_the_package_imports_itself_round_a_circle() -> None:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    assert _circles(graph) == []


def test_the_engine_imports_torch_but_never_lightning() -> None:
    for path in (PACKAGE / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            outside = [
                name
                for name in names
                if name.split(".")[0] == "lightning"
                or (name.startswith("lightning_fsdp.") and not name.startswith("lightning_fsdp.engine"))
            ]
            assert not outside, f"{path.relative_to(PACKAGE)} imports {outside}"


def test_importing_the_engine_leaves_lightning_unloaded() -> None:
    """In a fresh interpreter: the engine alone (plain torchrun) does not pay for importing Lightning."""
    program = "import sys\nimport lightning_fsdp.engine\nassert 'lightning' not in sys.modules, sorted(sys.modules)\n"
    subprocess.run([sys.executable, "-c", program], check=True, cwd=PACKAGE.parent, timeout=120)


def test_fabric_stands_on_the_adapter_never_on_the_trainer() -> None:
    """Lightning's direction: the Trainer's package may build on what Fabric's uses, never the reverse."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    for name, path in files.items():
        if name.startswith("lightning_fsdp.fabric"):
            trainer = sorted(m for m in _imports(path, set(files)) if m.startswith("lightning_fsdp.trainer"))
            assert not trainer, f"{path.relative_to(PACKAGE)} imports {trainer}"


def test_no_text_of_the_package_cites_a_path_outside_the_repository() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert "../shared" not in path.read_text(), f"{path.relative_to(PACKAGE)} cites ../shared"


TRAINER_ONLY = ("empty_init", "sync_grads_each_micro_batch", "save_trainable_only")


def _keywords(strategy: type) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(strategy).parameters.values()
    return {p.name: p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_both_strategies_write_the_same_shared_arguments() -> None:
    """Each strategy writes the shared arguments in its own signature (as Lightning's do): the same names, types and
    defaults, but ``state_dict_type``'s (one file for the Trainer, a folder for Fabric, as in Lightning)."""
    trainer, fabric = _keywords(FSDPStrategy), _keywords(FabricFSDPStrategy)
    assert [name for name in trainer if name not in TRAINER_ONLY] == list(SHARED_ARGUMENTS)
    assert list(fabric) == list(SHARED_ARGUMENTS)
    for name in SHARED_ARGUMENTS:
        assert trainer[name].annotation == fabric[name].annotation, name
        if name != "state_dict_type":
            assert trainer[name].default == fabric[name].default, name
    assert (trainer["state_dict_type"].default, fabric["state_dict_type"].default) == ("full", "sharded")
    assert FSDPStrategy().state_dict_type == "full" and FabricFSDPStrategy().state_dict_type == "sharded"


@pytest.mark.parametrize("strategy", [FSDPStrategy, FabricFSDPStrategy])
def test_a_config_parser_sees_every_shared_argument_with_its_type_and_default(strategy: type) -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(strategy, "strategy")
    defaults = parser.get_defaults().strategy
    for name, parameter in _keywords(strategy).items():
        assert name in defaults, name
        assert defaults[name] == parameter.default, name
    assert "kwargs" not in defaults
    parsed = parser.parse_args(
        ["--strategy.sharding_strategy", "SHARD_GRAD_OP", "--strategy.limit_all_gathers", "false"]
    )
    assert parsed.strategy.sharding_strategy == "SHARD_GRAD_OP" and parsed.strategy.limit_all_gathers is False
    with pytest.raises(Exception, match="sharding_strategy"):
        parser.parse_args(["--strategy.sharding_strategy", "HALF_SHARD"])
    with pytest.raises(Exception, match="state_dict_type"):
        parser.parse_args(["--strategy.state_dict_type", "folder"])


def test_a_keyword_outside_the_definition_is_still_refused_with_a_sentence() -> None:
    for strategy in (FSDPStrategy, FabricFSDPStrategy):
        with pytest.raises(ValueError, match="policy=1, which has no meaning for lightning_fsdp"):
            strategy(policy=1)
