"""The documentation builds, its snippets run, and what it quotes exists (issue 27).

Every fenced block of README.md and docs/*.md is one of three kinds, and a block that is none of them fails:

- **executed** here: a ```python block runs in this process (the blocks of one page in order, in one namespace, in a
  temporary working folder); a ```bash line of the ``lightning-fsdp`` CLI that asks for ``--help`` or ``estimate``
  runs in this process too;
- an **excerpt**, marked ``<!-- excerpt: PATH -->`` on the line above it: its text must appear verbatim in PATH (a
  line ``...`` separates pieces that must appear in that order), and PATH must be a file that an existing test runs
  (``EXCERPTED_FILES`` names that test);
- a **mapped** command (``MAPPED_COMMANDS``): a ```bash line that trains or converts for real, which an existing test
  runs in the same form (the table names the test and what differs).

```text blocks are allowed on the troubleshooting page only; each is an error message that must be in the package's
source (``test_troubleshooting_messages_are_in_the_source``). mkdocs builds the site with ``--strict``, so a broken
link, anchor or API reference fails (``test_mkdocs_build_is_strict``).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
REFERENCE = REPO / "docs" / "reference.md"

# Files the docs quote from, and the existing test that runs each (a test file and one of its test functions).
EXCERPTED_FILES = {
    "examples/trainer_api.py": "tests/test_demos_examples.py::test_trainer_api_example_trains_tests_and_checkpoints",
    "examples/finetune_hf.py": (
        "tests/test_demos_examples.py::test_finetune_hf_example_trains_lora_and_exports_for_transformers"
    ),
    "examples/train_gpt.py": "tests/test_train_gpt_example.py::test_train_gpt_runs_under_torchrun_and_lowers_the_loss",
    # The test imports the example and runs its parse_args and train() on 2 and 4 ranks of its own launch.
    "examples/fabric_loop.py": "tests/test_fabric.py::test_fabric_two_ranks",
    "configs/demo.yaml": "tests/test_cli_configs.py::test_demo_trains_and_reports_checkpoint_and_logs",
    "tests/test_monitor.py": (
        "tests/test_monitor.py::test_the_file_starts_with_the_run_and_holds_every_rank_every_interval"
    ),
    "tests/test_uneven_data.py": (
        "tests/test_uneven_data.py::test_uneven_evaluation_under_fabric_finishes_with_ddps_values"
    ),
    "configs/from_lightning_fsdp.yaml": "tests/test_cli_configs.py::test_accelerator_configs_run_on_two_cpu_processes",
    "configs/hybrid_multinode.yaml": "tests/test_cli_configs.py::test_accelerator_configs_run_on_two_cpu_processes",
}

# Commands that train or write checkpoints: the test that runs the same command, and how its run differs.
MAPPED_COMMANDS = {
    "bash scripts/demo.sh": (
        "tests/test_cli_configs.py::test_demo_trains_and_reports_checkpoint_and_logs",
        "the script runs `lightning-fsdp fit --config configs/demo.yaml`; the test runs that with a tiny model",
    ),
    "bash scripts/test.sh": (
        "tests/test_docs.py::test_every_snippet_is_executed_excerpted_or_mapped",
        "the suite itself: .ci/run runs scripts/test.sh (lint, then pytest, this file included)",
    ),
    "lightning-fsdp fit --config configs/demo.yaml --trainer.max_steps 50 --model.n_layer 2": (
        "tests/test_cli_configs.py::test_demo_trains_and_reports_checkpoint_and_logs",
        "the same command with a tinier model and 2 steps",
    ),
    "lightning-fsdp report runs/demo/version_0": (
        "tests/test_report.py::test_cli_writes_where_out_says_and_fit_reports_a_monitored_run",
        "the CLI's main() on a run folder the test writes (and fit's own report, as in the demo)",
    ),
    "python examples/finetune_hf.py --make-tiny runs/tiny_llama": (
        "tests/test_demos_examples.py::test_finetune_hf_example_trains_lora_and_exports_for_transformers",
        "the same, into a temporary folder",
    ),
    "python examples/finetune_hf.py --pretrained runs/tiny_llama": (
        "tests/test_demos_examples.py::test_finetune_hf_example_trains_lora_and_exports_for_transformers",
        "the same with --lora-rank 4 --max-steps 2",
    ),
    "python examples/fabric_loop.py --steps 40": (
        "tests/test_fabric.py::test_fabric_two_ranks",
        "the example's parse_args and train() with --steps 3, on ranks the test launches",
    ),
    "python examples/fabric_loop.py --resume out/fabric-ckpt": (
        "tests/test_fabric.py::test_fabric_two_ranks",
        "train() again with resume= the checkpoint the first run wrote",
    ),
    "torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 60": (
        "tests/test_train_gpt_example.py::test_train_gpt_runs_under_torchrun_and_lowers_the_loss",
        "python -m torch.distributed.run, the same flags, 6 steps of a smaller model",
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 "
    "-m lightning_fsdp.cli fit --config configs/hybrid_multinode.yaml": (
        "tests/test_two_nodes.py::test_two_claimed_nodes_on_one_host_share_memory_in_every_group",
        "two agents on one host, --nproc-per-node 2, running tests/scripts/two_nodes.py (HYBRID_SHARD, FULL_SHARD); "
        "the config itself runs on one node in test_cli_configs.py",
    ),
    "lightning-fsdp convert ckpts/last.ckpt consolidated.ckpt --to full": (
        "tests/test_checkpoint_resume.py::test_lightning_consolidate_and_our_convert_give_the_same_checkpoint",
        "the CLI's main() with these arguments on a sharded folder of a 2-rank run",
    ),
    "lightning-fsdp convert consolidated.ckpt resharded.ckpt --to sharded": (
        "tests/test_checkpoint_formats.py::test_convert_between_forms_offline",
        "convert(..., 'sharded'), the function behind the CLI, on a full file",
    ),
    "lightning-fsdp convert ckpts/last.ckpt model.safetensors --to safetensors --strip-prefix model.": (
        "tests/test_checkpoint_resume.py::test_safetensors_output_reads_back_as_the_weights",
        "the CLI's main() with these arguments",
    ),
    "python -m lightning.pytorch.utilities.consolidate_checkpoint ckpts/last.ckpt": (
        "tests/test_checkpoint_resume.py::test_lightning_consolidate_and_our_convert_give_the_same_checkpoint",
        "the same module as a subprocess on a sharded folder",
    ),
}

LANGUAGES = {"python", "bash", "shell", "yaml", "text"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
EXCERPT = re.compile(r"<!-- excerpt: (?P<path>\S+) -->\s*\Z")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    language: str
    text: str
    excerpt_of: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    source = page.read_text()
    found = []
    for match in FENCE.finditer(source):
        before = source[: match.start()]
        marker = EXCERPT.search(before)
        body = "\n".join(line[len(match["indent"]) :] for line in match["body"].splitlines())
        found.append(Snippet(page, before.count("\n") + 1, match["lang"], body, marker["path"] if marker else None))
    return found


ALL = [snippet for page in PAGES for snippet in snippets(page)]


def commands(text: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    result = []
    for line in joined.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command and not command.startswith("#"):
            result.append(re.sub(r"\s+", " ", command))
    return result


def executable_cli(command: str) -> list[str] | None:
    """The arguments of a ``lightning-fsdp`` command cheap enough to run here (help, estimate), else None."""
    words = shlex.split(command)
    if words[0] != "lightning-fsdp":
        return None
    if "--help" in words or "-h" in words or words[1:2] == ["estimate"]:
        return words[1:]
    return None


def test_excerpt_and_mapping_tables_name_existing_tests() -> None:
    for target in [*EXCERPTED_FILES.values(), *(test for test, _ in MAPPED_COMMANDS.values())]:
        path, name = target.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{target} does not exist"
    for path in EXCERPTED_FILES:
        assert (REPO / path).is_file(), path


def test_every_snippet_is_executed_excerpted_or_mapped() -> None:
    """Each block is of a known kind, and each table entry is used (a stale one would hide a renamed command)."""
    used = set()
    problems = []
    for snippet in ALL:
        if snippet.language not in LANGUAGES:
            problems.append(f"{snippet.where}: a ```{snippet.language or '(no language)'} block")
        elif snippet.language == "text" and snippet.page != TROUBLESHOOTING:
            problems.append(f"{snippet.where}: ```text blocks are for the troubleshooting page's messages")
        elif snippet.excerpt_of is not None:
            if snippet.excerpt_of not in EXCERPTED_FILES:
                problems.append(f"{snippet.where}: {snippet.excerpt_of} is not in EXCERPTED_FILES")
        elif snippet.language in ("bash", "shell"):
            for command in commands(snippet.text):
                if command in MAPPED_COMMANDS:
                    used.add(command)
                elif executable_cli(command) is None:
                    problems.append(f"{snippet.where}: `{command}` is neither executed nor in MAPPED_COMMANDS")
        elif snippet.language == "yaml":
            problems.append(f"{snippet.where}: a YAML block must be an excerpt of a config")
    problems += [
        f"MAPPED_COMMANDS has `{command}`, which no snippet shows" for command in MAPPED_COMMANDS.keys() - used
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", [s for s in ALL if s.excerpt_of], ids=lambda s: s.where)
def test_excerpt_is_verbatim_in_its_file(snippet: Snippet) -> None:
    text = "\n" + (REPO / snippet.excerpt_of).read_text()
    position = 0
    for piece in re.split(r"^\.\.\.\n", snippet.text + "\n", flags=re.M):
        found = text.find("\n" + piece, position)
        assert found >= 0, f"{snippet.where}: this part is not in {snippet.excerpt_of} (in this order):\n{piece}"
        position = found + len(piece)


@pytest.mark.parametrize(
    "snippet",
    [
        s
        for s in ALL
        if s.language in ("bash", "shell") and not s.excerpt_of and any(map(executable_cli, commands(s.text)))
    ],
    ids=lambda s: s.where,
)
def test_cli_snippet_runs(snippet: Snippet, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_fsdp.cli import main

    for command in commands(snippet.text):
        args = executable_cli(command)
        if args is None:
            continue
        try:
            main(args)
        except SystemExit as exit_:
            assert exit_.code in (0, None), f"{snippet.where}: `{command}` exited with {exit_.code}"
        assert capsys.readouterr().out.strip(), f"{snippet.where}: `{command}` printed nothing"


PYTHON_PAGES = sorted({s.page for s in ALL if s.language == "python" and not s.excerpt_of})


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_python_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's blocks in order, in one namespace, as a reader pastes them into one session."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        for snippet in snippets(page):
            if snippet.language != "python" or snippet.excerpt_of:
                continue
            code = compile(snippet.text, snippet.where, "exec")
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)  # noqa: S102 -- the documentation's own snippets
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # a snippet that failed before its destroy_process_group: spare the next tests
            dist.destroy_process_group()


def _templates() -> set[str]:
    """Every string literal of the package, with each formatted value of an f-string written as ``…``."""
    found = set()
    for path in (REPO / "lightning_fsdp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                found.add("".join(part.value if isinstance(part, ast.Constant) else "…" for part in node.values))
    return found


def test_troubleshooting_messages_are_in_the_source() -> None:
    messages = [s.text.strip() for s in snippets(TROUBLESHOOTING) if s.language == "text"]
    assert len(messages) >= 20
    templates = _templates()
    missing = []
    for message in messages:
        wanted = message[:-1] if message.endswith("…") else message  # a trailing … : the message starts so
        assert len(wanted.replace("…", "")) >= 25, f"too little of the message to identify it: {message}"
        if not any(wanted in template for template in templates):
            missing.append(message)
    assert not missing, "not in lightning_fsdp's source:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_and_docs_paths_exist() -> None:
    """README's relative links (GitHub renders them; mkdocs does not build README), and the repository paths the docs
    name in code spans (mkdocs cannot link outside docs/)."""
    problems = []
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists():
            problems.append(f"README.md links to {target}, which does not exist")
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                problems.append(f"README.md links to {target}, a heading that does not exist")
    for page in PAGES:
        for name in re.findall(
            r"`((?:examples|configs|scripts|tests|benchmarks|lightning_fsdp)/[\w./-]*)`", page.read_text()
        ):
            if not (REPO / name).exists():
                problems.append(f"{page.relative_to(REPO)} names {name}, which does not exist")
    assert not problems, "\n".join(problems)


def test_api_identifiers_are_all_in_the_reference_page() -> None:
    """One file to edit when a module moves."""
    for page in PAGES:
        if page != REFERENCE:
            assert not re.search(r"^::: ", page.read_text(), re.M), f"{page}: keep ::: identifiers in {REFERENCE}"
    assert re.search(r"^::: lightning_fsdp\.", REFERENCE.read_text(), re.M)


def test_mkdocs_build_is_strict(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        "mkdocs.yml",
        "--site-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "reference" / "index.html").read_text().count("doc-heading") >= 10
