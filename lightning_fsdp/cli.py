"""The ``lightning-fsdp`` command: LightningCLI with the demo GPT and corpus as the default model and data.

    lightning-fsdp fit --config configs/demo.yaml                 # also: validate | test | predict
    lightning-fsdp fit --config configs/demo.yaml --model.n_layer 2 --trainer.max_steps 50
    lightning-fsdp convert SRC DST --to full|sharded|safetensors|hf  # offline, one process, no model code
    lightning-fsdp estimate --params 1.3e9 --world-size 8         # per-rank memory of each sharding strategy
    lightning-fsdp report runs/demo/version_0                     # an HTML page from the FSDPMonitor's records

Model and data are chosen by ``class_path`` (any LightningModule / LightningDataModule); without one they are
``LitGPT`` and ``CharDataModule``. ``trainer.strategy`` may be a registered name (``myfsdp``,
``myfsdp_shard_grad_op``, ``myfsdp_cpu_offload``) or ``class_path: lightning_fsdp.FSDPStrategy`` with
``init_args``. The names resolve because this module lives inside the ``lightning_fsdp`` package: importing it
runs ``lightning_fsdp/__init__.py`` first, which registers them, before any Trainer is built.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_fsdp.checkpoint.convert import FORMATS, convert
from lightning_fsdp.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.estimate import main as estimate_main
from lightning_fsdp.monitor import FSDPMonitor
from lightning_fsdp.report import MONITOR_FILE, ReportError, write_report
from lightning_fsdp.report import main as report_main
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

__all__ = ["LightningFSDPCLI", "convert_main", "main", "report_artifacts"]

DEFAULT_MODEL = "lightning_fsdp.demos.lit_gpt.LitGPT"
DEFAULT_DATA = "lightning_fsdp.demos.datamodule.CharDataModule"


class LightningFSDPCLI(LightningCLI):
    """LightningCLI with the demo defaults, ending ``fit`` by saying where the checkpoint, logs and report are."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def after_fit(self) -> None:
        """Called by LightningCLI after ``trainer.fit`` (it looks the hook up by name)."""
        report_artifacts(self.trainer)


def report_artifacts(trainer: Trainer) -> None:
    """Print, on rank 0, the checkpoint fit wrote last and the logger's folder: the run's last lines.

    With an ``FSDPMonitor`` among the callbacks, the HTML report is written beside its records (its ``dirpath``,
    by default the logger's folder) and its path printed last. A report that cannot be written is said so, not
    raised: training and its checkpoint are done, and ``lightning-fsdp report`` can try again. Every rank must
    call it: ``trainer.log_dir`` is a broadcast from rank 0.
    """
    log_dir = trainer.log_dir
    if not trainer.is_global_zero:
        return
    callback = trainer.checkpoint_callback
    checkpoint = callback.last_model_path or callback.best_model_path if callback is not None else ""
    print(f"checkpoint: {Path(checkpoint).resolve() if checkpoint else 'none (no ModelCheckpoint saved one)'}")
    print(f"logs: {Path(log_dir).resolve() if log_dir else 'none (no logger)'}", flush=True)
    monitors = [monitor for monitor in trainer.callbacks if isinstance(monitor, FSDPMonitor)]
    run_dir = (monitors[0].dirpath or log_dir) if monitors else None
    if run_dir and (Path(run_dir) / MONITOR_FILE).is_file():
        try:
            print(f"report: {write_report(run_dir).resolve()}", flush=True)
        except (OSError, ReportError) as err:
            print(f"report: not written: {err}", flush=True)


def convert_main(argv: list[str]) -> None:
    """``lightning-fsdp convert``: argparse rather than LightningCLI, since it builds no Trainer."""
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp convert",
        description="Convert a checkpoint between a sharded folder, one full .ckpt, safetensors weights and a Hugging "
        "Face weights folder (--to hf, which from_pretrained reads).",
    )
    parser.add_argument("src", help="a sharded checkpoint folder or a full .ckpt file (or an fsspec URL: s3://...)")
    parser.add_argument("dst", help="where to write the result, a path or a URL (it appears only when complete)")
    parser.add_argument("--to", choices=FORMATS, default="full", help="the output format (default: %(default)s)")
    parser.add_argument(
        "--strip-prefix",
        default="",
        help="drop this prefix from names (safetensors, hf), e.g. 'model.'; hf strips the shared first part by default",
    )
    parser.add_argument("--config", default=None, help="hf: the model's config.json, copied into DST")
    parser.add_argument(
        "--max-shard-size",
        type=float,
        default=DEFAULT_MAX_SHARD_BYTES / 1e9,
        help="hf: split the weights into files of at most this many GB (default: %(default)g, as transformers)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is a checkpoint of the --to form (anything else there is never replaced)",
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="allow SRC to unpickle more than plain data; only for files you wrote: unpickling can run code",
    )
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default=None,
        help='for URLs: the store\'s fsspec options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' '
        "(fsspec's and the store's own configuration, FSSPEC_S3_* or AWS_* variables, apply too)",
    )
    options = parser.parse_args(argv)
    try:
        convert(
            options.src,
            options.dst,
            options.to,
            strip_prefix=options.strip_prefix,
            trust=options.trust_checkpoint,
            overwrite=options.overwrite,
            config=options.config,
            max_shard_bytes=int(options.max_shard_size * 1e9),
            storage_options=options.storage_options,
        )
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        parser.exit(2, f"lightning-fsdp convert: error: {err}\n")
    print(f"wrote {options.dst if is_remote(options.dst) else Path(options.dst).resolve()}")


SUBCOMMANDS = {
    "fit": "train a model (LightningCLI: --config configs/<name>.yaml, --model.*, --trainer.*)",
    "validate": "run the validation loop of a model once",
    "test": "run the test loop of a model once",
    "predict": "run prediction over a datamodule's predict set",
    "convert": "convert a checkpoint between a sharded folder, one full .ckpt and safetensors weights",
    "estimate": "print the per-rank memory of each sharding strategy for a model size, before trying it",
    "report": "write an HTML page of a run's step time, memory, communication and stragglers (FSDPMonitor's records)",
}


def print_overview() -> None:
    """``lightning-fsdp --help``: every subcommand with one line (LightningCLI's own help knows only four)."""
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp",
        description="Train, evaluate and convert models sharded by lightning_fsdp's FSDP engine.",
        epilog="Run 'lightning-fsdp <subcommand> --help' for the options of one subcommand.",
    )
    subcommands = parser.add_subparsers(title="subcommands", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, summary in SUBCOMMANDS.items():
        subcommands.add_parser(name, help=summary)
    parser.print_help()


def main(args: list[str] | None = None) -> None:
    """The console script's entry point; ``args`` replaces ``sys.argv[1:]`` (for tests).

    After a successful run that joined a process group, the process ends with ``os._exit(0)``: a gloo worker
    thread may still be releasing its last collective's tensors while the interpreter shuts down, which aborts
    a finished run with SIGABRT (see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py). Everything is
    written and printed by then. A failure raises as usual.
    """
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        print_overview()
        if not argv:
            raise SystemExit(2)  # a usage error: no subcommand
        return
    if argv and argv[0] == "convert":
        convert_main(argv[1:])
        return
    if argv and argv[0] == "estimate":
        estimate_main(argv[1:])
        return
    if argv and argv[0] == "report":
        report_main(argv[1:])
        return
    LightningFSDPCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # A re-run into the same log folder replaces the saved config instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    exit_after_distributed_run()


if __name__ == "__main__":
    main()
