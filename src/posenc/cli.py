"""The ``posenc`` command. Subcommands only parse arguments and delegate to the package."""

from __future__ import annotations

import argparse
import platform
import sys
import warnings
from collections.abc import Callable, Sequence

from posenc.lab.config import CLI_FLAGS


def _info(args: argparse.Namespace) -> int:
    import torch

    import posenc
    from posenc.registry import ENCODINGS
    from posenc.rope.frequencies import SCALINGS

    print(f"posenc {posenc.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print("encodings:")
    for name, cls in ENCODINGS.items():
        print(f"  {name:<11} acts on {cls.acts_on.value}")
    print(f"rope types: {', '.join(SCALINGS)}")
    print(f"rotation backends: {', '.join(posenc.available_backends())}")
    return 0


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="list encodings, rope types, backends and versions")
    _add_import_option(p)
    p.set_defaults(func=_info)


def _add_import_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (a dotted name found on PYTHONPATH or in the current folder, or a path to a .py "
        "file), so that its posenc.register / posenc.register_scaling calls add its encodings and rope types "
        "(repeatable; default none; under torchrun every rank imports it, and posenc lab refuses ranks whose "
        "imports registered different ones)",
    )


class ImportFailed(Exception):
    """A --import module that could not be found, or raised while it was imported."""


def import_modules(names: Sequence[str]) -> list[str]:
    """Import each --import module in order, for the registrations it makes. Returns what the lab records of each:
    a dotted name as given, a file as its absolute path (so that a report or resume from another folder finds it).
    Raises ImportFailed with one line naming the module."""
    return [_import_module(name) for name in names]


def _import_module(text: str) -> str:
    import importlib
    import os
    from pathlib import Path

    is_path = text.endswith(".py") or os.sep in text or (os.altsep is not None and os.altsep in text)
    try:
        if is_path:
            path = Path(text).expanduser().resolve()
            if path.is_dir() and (path / "__init__.py").is_file():
                raise ImportFailed(
                    f"--import {text}: {path} is a package; import it by name, --import {path.name}, from its parent "
                    f"folder ({path.parent}) or with that folder on PYTHONPATH"
                )
            if path.is_dir():
                raise ImportFailed(f"--import {text}: {path} is a folder; pass the path to a .py file in it")
            if not path.is_file():
                raise ImportFailed(f"--import {text}: no such file ({path}); pass the path to a .py file")
            _import_file(path)
            return str(path)
        # A console script's sys.path holds its bin folder, not the current one: added as `python -m` would (at the
        # end, so that a file of the current folder never shadows an installed module).
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(text)
        except ModuleNotFoundError as error:
            # Only the module itself (or its package) missing; a module it imports that is missing is its error.
            if error.name is None or not (text == error.name or text.startswith(error.name + ".")):
                raise
            raise ImportFailed(
                f"--import {text}: no module named {error.name!r} on the module search path; add the folder that "
                f"holds it to PYTHONPATH, or pass the path to its .py file (--import path/to/{text.split('.')[-1]}.py)"
            ) from None
        if getattr(module, "__file__", None) is None and hasattr(module, "__path__"):
            # A folder without __init__.py imports as a namespace package: nothing runs, nothing is registered.
            raise ImportFailed(
                f"--import {text}: a folder without __init__.py, whose import runs no code; pass the .py file that "
                "registers, or a module in that folder (folder.module)"
            )
        return text
    except ImportFailed:
        raise
    except (Exception, SystemExit) as error:  # the module's own code: its error in one line, with where it was raised
        import traceback

        frames = traceback.extract_tb(error.__traceback__)
        ours = [f for f in frames if "importlib" not in f.filename and f.filename != __file__]
        where = f" (at {ours[-1].filename}:{ours[-1].lineno})" if ours else ""
        message = str(error).strip().splitlines()
        detail = f": {message[0]}" if message else ""
        raise ImportFailed(f"--import {text}: importing it raised {type(error).__name__}{detail}{where}") from error


def _import_file(path) -> None:  # path: pathlib.Path
    import importlib.util

    # Under its file's name, as `python path.py` would not: so that its classes pickle and show a readable module.
    # A name taken by another module (a file called json.py) gets a private one instead of replacing it.
    name = path.stem
    existing = sys.modules.get(name)
    if existing is not None:
        if getattr(existing, "__file__", None) == str(path):
            return  # imported already (named twice)
        name = f"_posenc_import_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportFailed(f"--import {path}: not a Python module; pass a .py file or a dotted module name")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _rope_param(text: str) -> tuple[str, object]:
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. beta_fast=16), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _positive_int(text: str) -> int:
    """A size of the figures: refused here, naming the flag, where FigureConfig named its field (head_dim)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    """A float option: nan and inf are refused here (nan != nan broke later comparisons, inf any arithmetic)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _add_figure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to draw (give --config, or any of the others; defaults: d=64, base=10000)")
    g.add_argument(
        "--config", metavar="JSON", help="figure config, or a Hugging Face model config.json (or its folder)"
    )
    g.add_argument(
        "--layer-type",
        metavar="TYPE",
        help="for a --config with one rope dict per layer type (Gemma 3: sliding_attention, full_attention), the one "
        "to draw",
    )
    g.add_argument("--head-dim", type=_positive_int, help="d per attention head (default 64)")
    g.add_argument("--base", type=_finite_float, help="rope_theta (default 10000)")
    g.add_argument(
        "--rope-type",
        help="a RoPE scaling type (see `posenc info`); the parameters it needs that no --factor / --rope-param gives "
        "are the figures' examples (posenc.analysis.EXAMPLE_ROPE_PARAMETERS)",
    )
    g.add_argument("--factor", type=_finite_float, help="the scaling type's context extension factor")
    g.add_argument(
        "--rope-param",
        type=_rope_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another rope_parameters entry, e.g. beta_fast=16 (repeatable; VALUE is read as JSON if it parses)",
    )
    g.add_argument(
        "--train-len",
        type=_positive_int,
        help="training context L (default: the scaling's original_max_position_embeddings when given, else 2048)",
    )
    g.add_argument(
        "--eval-len", type=_positive_int, help="extended context (default: the scaling factor times train-len, else 4x)"
    )
    g.add_argument("--num-heads", type=_positive_int, help="heads for the bias matrices (default 8)")
    g.add_argument(
        "--interleaved",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="adjacent pairs (x0, x1), (x2, x3) as in RoFormer, GPT-J, DeepSeek, rather than split halves "
        "(--no-interleaved: split halves, where a --run's model had adjacent pairs)",
    )


def _figure_config(args: argparse.Namespace, run_dir: str | None = None):  # -> posenc.analysis.FigureConfig | None
    """The figure config the options describe, or None for the default (the run's own model with ``run_dir``).
    With ``run_dir``, sizes the options leave out (head dim, lengths, heads) are the run's, not the defaults."""
    from posenc.analysis import FigureConfig
    from posenc.analysis.run import run_figure_config
    from posenc.rope.frequencies import turns_fraction_of_pairs

    flags = {
        "head_dim": args.head_dim,
        "base": args.base,
        "rope_type": args.rope_type,
        "train_len": args.train_len,
        "eval_len": args.eval_len,
        "num_heads": args.num_heads,
        "interleaved": args.interleaved,
    }
    params: dict[str, object] = {}
    for key, value in args.rope_param:
        if key in params and (params[key] != value or isinstance(params[key], bool) != isinstance(value, bool)):
            # Kept the last one without a word, where --factor beside factor= is refused. 2 and 2.0 agree; 1 and
            # true (1 == True) do not.
            raise ValueError(
                f"--rope-param {key} is given twice with different values, {params[key]!r} and {value!r}; keep one"
            )
        params[key] = value
    if args.factor is not None:
        if params.get("factor", args.factor) != args.factor:
            raise ValueError(
                f"factor is given twice with different values: --factor {args.factor:g} and "
                f"--rope-param factor={params['factor']}; keep one"
            )
        params["factor"] = args.factor
    if args.config is not None:
        given = _flags_given(args)
        if given:
            raise ValueError(f"--config already says what to draw; drop {', '.join(sorted(set(given)))}")
        return FigureConfig.from_json(args.config, layer_type=args.layer_type)
    if args.layer_type is not None:
        raise ValueError("--layer-type picks a rope dict of a Hugging Face --config; give --config, or drop it")
    if not params and all(v is None for v in flags.values()):
        return None  # the default, or the run's own model for --run / report
    _check_type_reads_flags(args, params)
    run = run_figure_config(run_dir) if run_dir is not None else None
    if run is not None:
        # The run's lengths unless a length is given, as --train-len or as the scaling's original length.
        own_lengths = flags["train_len"] is None and "original_max_position_embeddings" not in params
        sizes = ("head_dim", "num_heads", "interleaved") + (("train_len", "eval_len") if own_lengths else ())
        flags.update({key: getattr(run, key) for key in sizes if flags[key] is None})
        # And the RoPE it trained with (an --hf-config model's theta and rotary fraction), unless given.
        if flags["base"] is None and "rope_theta" not in params:
            flags["base"] = run.base
        partial = run.rope_parameters.get("partial_rotary_factor")
        whole_head = turns_fraction_of_pairs(flags["rope_type"])
        if partial is not None and "partial_rotary_factor" not in params and not whole_head:
            params["partial_rotary_factor"] = partial
    return FigureConfig.from_flags(rope_parameters=params, **flags)


def _check_type_reads_flags(args: argparse.Namespace, params: dict[str, object]) -> None:
    """Every key --factor / --rope-param give is one the rope type reads. Left to the parser, the error named a
    rope_parameters dict the user never wrote (and, with no --rope-type, a type 'default' they never chose). A type
    named twice, or one that is not a known name, is left to FigureConfig.from_flags and its parser to report."""
    from posenc.rope.frequencies import SCALINGS
    from posenc.rope.parameters import LEGACY_TYPES, OPTIONAL_KEYS, REQUIRED_KEYS, unread_keys

    names = [name for name in (args.rope_type, params.get("rope_type"), params.get("type")) if name is not None]
    if not all(isinstance(name, str) for name in names):
        return
    names = [name for name in names if name]  # '' names no type, as in parse_rope_parameters
    if len({LEGACY_TYPES.get(name, name) for name in names}) > 1:
        return
    chosen = names[0] if names else None
    kind = LEGACY_TYPES.get(chosen, chosen) if chosen else "default"
    if kind not in REQUIRED_KEYS or kind not in OPTIONAL_KEYS:
        return
    unread = unread_keys(kind, params)
    if not unread:
        return
    key = "factor" if "factor" in unread else unread[0]
    flag = "--factor" if key == "factor" and args.factor is not None else f"--rope-param {key}"
    # .get: a type registered in SCALINGS without key lines is reported by the parser, not as a KeyError here.
    readers = [
        name for name in SCALINGS if key in REQUIRED_KEYS.get(name, frozenset()) | OPTIONAL_KEYS.get(name, frozenset())
    ]
    own = ", ".join(sorted(REQUIRED_KEYS[kind] | OPTIONAL_KEYS[kind])) or "no parameters of its own"
    given = f"--rope-type {args.rope_type}" if args.rope_type else f"rope type {chosen!r}"
    if not readers:
        takes = f" ({given} takes {own})" if chosen is not None else ""
        raise ValueError(f"{flag}: no rope type reads {key!r}; check its spelling{takes}")
    add = f"--rope-type {readers[0]}" if len(readers) == 1 else f"a --rope-type that reads it: {', '.join(readers)}"
    if chosen is None:
        raise ValueError(f"{flag} needs a scaling --rope-type (plain RoPE has no {key}); add {add}")
    raise ValueError(f"{flag} is not a parameter of {given} (it takes {own}); drop it, or use {add}")


def _note_in_progress(command: str, note: str | None) -> None:
    """Says on stderr that a lab run is writing the run folder, whose results may then be an earlier run's."""
    if note is not None:
        print(f"posenc {command}: note: {note}", file=sys.stderr)


def _plot(args: argparse.Namespace) -> int:
    from posenc.analysis.plots import check_names, figure_inputs, write_figures
    from posenc.analysis.run import in_progress

    try:
        names = check_names(args.names)
        config = _figure_config(args, args.run)
        inputs = figure_inputs(config, args.run, need_entropy="attention_entropy" in names)
        paths = write_figures(args.out, names, inputs, svg=args.svg, dpi=args.dpi)
        if args.run is not None:
            _note_in_progress("plot", in_progress(args.run))
    except (ValueError, TypeError) as err:
        print(f"posenc plot: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file that cannot be read (--config) or written (--out)
        print(f"posenc plot: error: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write the analysis figures (PNG, optionally SVG) drawn from the real code")
    p.add_argument("names", nargs="*", metavar="NAME", help="figures to draw (default: all); see the list below")
    p.add_argument("--out", required=True, help="directory to write NAME.png (and NAME.svg) into")
    p.add_argument("--svg", action="store_true", help="also write SVG")
    p.add_argument("--dpi", type=int, default=110, help="PNG resolution (default 110)")
    p.add_argument(
        "--run",
        metavar="DIR",
        help="a lab run folder: attention_entropy draws the entropy it measured, and the figures are drawn for "
        "its model unless options say otherwise",
    )
    _add_figure_options(p)
    _add_import_option(p)
    from posenc.analysis.plots import FIGURES

    p.epilog = "figures: " + ", ".join(FIGURES)
    p.set_defaults(func=_plot)


def _report(args: argparse.Namespace) -> int:
    from posenc.analysis.report import write_report
    from posenc.analysis.run import in_progress

    try:
        if not args.figures:
            _check_no_figure_options(args)
        config = _figure_config(args, args.run_dir) if args.figures else None
        running = in_progress(args.run_dir)  # looked at once: the page and stderr say the same
        path = write_report(
            args.run_dir, out=args.out, config=config, figures=None if args.figures else [], running=running
        )
        _note_in_progress("report", running)
    except (ValueError, TypeError) as err:
        print(f"posenc report: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file that cannot be read or written
        print(f"posenc report: error: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _flags_given(args: argparse.Namespace) -> list[str]:
    """The figure options given that say what to draw beside --config (and --layer-type), as typed."""
    names = ("head_dim", "base", "rope_type", "factor", "train_len", "eval_len", "num_heads")
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]
    given += ["--rope-param"] * bool(args.rope_param)
    return given + ([] if args.interleaved is None else ["--interleaved" if args.interleaved else "--no-interleaved"])


def _check_no_figure_options(args: argparse.Namespace) -> None:
    """With --no-figures, an option that says what the figures draw would do nothing: refused, not ignored."""
    given = [f"--{name.replace('_', '-')}" for name in ("config", "layer_type") if getattr(args, name) is not None]
    given += _flags_given(args)
    if given:
        raise ValueError(
            f"--no-figures leaves out the figures that {', '.join(given)} describe{'s' * (len(given) == 1)}; "
            "drop one or the other"
        )


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write a self-contained report.html for a lab run folder")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `posenc lab` (holds results.csv)")
    p.add_argument("--out", help="where to write the page (default RUN_DIR/report.html)")
    p.add_argument("--no-figures", dest="figures", action="store_false", help="leave out the analysis figures")
    _add_figure_options(p)
    _add_import_option(p)
    p.set_defaults(func=_report)


def _folder(text: str) -> str:
    """A folder argument: '' is refused, where the lab took it as no --out and wrote to its default folder."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder, got ''; leave --out out for lab-runs/PRESET")
    return text


def _comma_items(text: str, example: str) -> list[str]:
    """The items of a comma list, each stripped; an empty one (``rope,,alibi``, a trailing comma, '') is refused,
    where it was dropped without a word (and '' read as no extensions)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list like {example} with no empty item, got {text!r}")
    return items


def _comma_names(text: str) -> tuple[str, ...]:
    """'rope,alibi' -> ('rope', 'alibi'); 'none' -> () (for --extensions none)."""
    names = tuple(_comma_items(text, "rope,alibi (--encodings) or pi,yarn (--extensions)"))
    return () if names == ("none",) else names


def _comma_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in _comma_items(text, "64,128,256"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 64,128,256, got {text!r}") from None


# flag (argparse's name) -> LabConfig field, for the flags that override a preset's value.
_LAB_OVERRIDES = {flag[2:].replace("-", "_"): field for field, flag in CLI_FLAGS.items()}


def _lab(args: argparse.Namespace) -> int:
    import os
    import shlex

    from posenc.lab.runner import run_command

    overrides = {field: getattr(args, flag) for flag, field in _LAB_OVERRIDES.items()}
    if args.task_samples is not None and args.task is None and os.environ.get("RANK", "0") == "0":  # no preset has one
        # Taken without a word before. Not refused: it is part of the folder's configuration, and folders made
        # with it resume only with it.
        print(
            "posenc lab: note: --task-samples sets how many samples --task scores, and no task runs here, so it "
            "changes no number; it is still part of this run folder's configuration (a rerun resumes it only with "
            "the same --task-samples)",
            file=sys.stderr,
        )
    # The command as given (flags in a fixed order), recorded in results.json and report.md.
    given = [f"--preset {args.preset}"] + [
        f"--{flag.replace('_', '-')} {shlex.quote(_flag_text(getattr(args, flag)))}"
        for flag in (*_LAB_OVERRIDES, "out", "threads", "device")
        if getattr(args, flag) is not None
    ]
    given += [f"--import {shlex.quote(name)}" for name in args.imports]
    given += [] if args.figures else ["--no-figures"]
    return run_command(
        preset=args.preset,
        out=args.out,
        overrides=overrides,
        threads=args.threads,
        device="cpu" if args.device is None else args.device,
        progress=args.progress,
        command="posenc lab " + " ".join(given),
        imports=args.imported,
        figures=args.figures,
    )


def _flag_text(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def _add_lab(sub: argparse._SubParsersAction) -> None:
    # The names come from the lab's tables, read when the parser is built: a hand-written copy went stale.
    from posenc.lab.config import EXTENSIONS, FINETUNABLE, PRESETS, TASKS
    from posenc.registry import ENCODINGS

    p = sub.add_parser(
        "lab",
        help="train a tiny byte-level LM per encoding and measure how each extrapolates (nothing to download)",
        description="Train one tiny byte-level language model per encoding on the Python standard library's "
        "source, evaluate each at 1x-8x its training length with a sliding window, apply the RoPE extensions, "
        "and write results.csv, results.json, report.md, report.html and plots to --out. Rerunning resumes.",
    )
    p.add_argument("--preset", choices=tuple(PRESETS), default="default", help="sizes and budget")
    p.add_argument("--out", type=_folder, help="run folder (default lab-runs/PRESET); rerun the same command to resume")
    p.add_argument("--encodings", type=_comma_names, help=f"comma list (default all: {','.join(ENCODINGS)})")
    p.add_argument(
        "--extensions", type=_comma_names, help=f"comma list of {','.join(EXTENSIONS)}, or none (default all)"
    )
    p.add_argument("--seed", type=int, help="first seed (default 0)")
    p.add_argument("--seeds", type=int, help="number of seeds (default 1; full: 3)")
    p.add_argument(
        "--corpus",
        help="a text file, or a directory whose .txt .md .rst .py .c .h .json .toml .cfg .ini .html files are read "
        "(default: the Python stdlib)",
    )
    p.add_argument("--train-len", type=int, help="training context in bytes (eval lengths follow at 1x-8x)")
    p.add_argument("--eval-lengths", type=_comma_ints, help="comma list of eval lengths, each >= --train-len")
    p.add_argument("--score-len", type=int, help="final bytes of every window that are scored (<= --train-len)")
    p.add_argument("--eval-windows", type=int, help="windows per eval length")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--batch-size", type=int, help="windows per training step")
    p.add_argument("--lr", type=_finite_float, help="peak learning rate")
    p.add_argument("--dim", type=int, help="model width")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument(
        "--finetune-steps",
        type=int,
        help=f"fine-tune {' and '.join(FINETUNABLE)}, and plain rope as their control, at each target length (0: none)",
    )
    p.add_argument("--task", choices=TASKS, help="also measure exact-match and per-byte accuracy on a task")
    p.add_argument(
        "--task-samples", type=int, help="task samples per eval length (default 32; quick: 8; <= --eval-windows)"
    )
    p.add_argument(
        "--hf-config",
        metavar="PATH",
        help="build the rope model as this config.json's Hugging Face architecture (random init, the lab's sizes; "
        "runs rope only; needs transformers)",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads(N) for this run (default: torch's choice)")
    p.add_argument("--device", help="torch device (default cpu)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument(
        "--no-figures",
        dest="figures",
        action="store_false",
        help="leave the analysis figures out of report.html (its tables and the lab's plots stay; "
        "`posenc report RUN_DIR` draws them later)",
    )
    _add_import_option(p)
    p.set_defaults(func=_lab)


# Each entry adds one subcommand's parser; the parser's `func` does the work.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_info, _add_plot, _add_report, _add_lab]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posenc", description="Positional encodings for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "command", None)
    # Figure names after an option (`posenc plot --out d wavelengths`, or after `--`): argparse gives a positional
    # list only the words before the first option, and its intermixed parsing does not take subcommands.
    names = extra[1:] if extra[:1] == ["--"] else extra
    if extra and command == "plot" and not any(word.startswith("-") for word in names):
        args.names = [*args.names, *names]
    elif extra:
        # The subcommand's usage and name (`posenc info: error:`), not the top level's.
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        subcommands.get(command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    # A warning printed as one line naming the command, not Python's two with a source file and line of posenc's.
    # The format, not showwarning: recorders (pytest.warns, logging.captureWarnings) replace showwarning and still
    # get every warning.
    previous, warnings.formatwarning = warnings.formatwarning, _one_line_warning(command)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = previous


def _one_line_warning(command: str | None) -> Callable[..., str]:
    def format(message, category, filename, lineno, line=None) -> str:  # type: ignore[no-untyped-def]
        return f"posenc {command}: warning: {' '.join(str(message).splitlines())}\n"

    return format


def _run(args: argparse.Namespace) -> int:
    try:
        try:
            # Before anything reads the registries: the configuration's checks, the figures, the listing.
            args.imported = import_modules(args.imports)
        except ImportFailed as error:
            # Every torchrun rank imports for itself (each runs this command), and says which one failed.
            from posenc.lab.dist import rank_label

            print(f"posenc {args.command}: error{rank_label()}: {error}", file=sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # a slow --import's too
        # `posenc lab` says this itself, naming where its results are. The figures and the report are written whole
        # or not at all, so nothing they leave is half a file.
        print(f"\nposenc {args.command}: interrupted; the files written before it are complete", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
