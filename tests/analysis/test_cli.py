"""`posenc plot` and `posenc report`: parse, delegate, and turn bad input into a clear message and exit code 2."""

from __future__ import annotations

import json

import pytest

from posenc.cli import main
from posenc.lab import lock
from posenc.rope import frequencies
from posenc.rope.parameters import OPTIONAL_KEYS, REQUIRED_KEYS


def test_plot_writes_the_named_figures(tmp_path, capsys):
    assert (
        main(
            [
                "plot",
                "wavelengths",
                "pair_layouts",
                "--out",
                str(tmp_path),
                "--rope-type",
                "yarn",
                "--factor",
                "8",
                "--rope-param",
                "beta_fast=16",
                "--train-len",
                "512",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair_layouts.png", "wavelengths.png"]
    assert str(tmp_path / "wavelengths.png") in capsys.readouterr().out


def test_plot_takes_figure_names_after_options(tmp_path, capsys):
    # argparse stopped the name list at the first option: "unrecognized arguments: long_term_decay".
    assert main(["plot", "wavelengths", "--out", str(tmp_path), "--dpi", "30", "long_term_decay"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long_term_decay.png", "wavelengths.png"]
    # And after `--`, the usual end of options.
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "dash"), "--dpi", "30", "--", "pair_layouts"]) == 0
    assert sorted(p.name for p in (tmp_path / "dash").iterdir()) == ["pair_layouts.png", "wavelengths.png"]
    # The subcommand's usage and name, not the top level's.
    with pytest.raises(SystemExit):
        main(["plot", "--out", str(tmp_path), "--no-such-flag"])
    assert "posenc plot: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "extra"])
    err = capsys.readouterr().err
    assert err.startswith("usage: posenc info") and "posenc info: error: unrecognized arguments: extra" in err


@pytest.mark.parametrize("flag", ["--head-dim", "--train-len", "--eval-len", "--num-heads"])
def test_a_figure_size_below_one_is_refused_naming_the_flag(tmp_path, capsys, flag):
    """FigureConfig's message named its field ("head_dim must be a positive integer"), not the flag given."""
    with pytest.raises(SystemExit):
        main(["plot", "wavelengths", "--out", str(tmp_path), flag, "0"])
    assert f"posenc plot: error: argument {flag}: expected a positive integer, got '0'" in capsys.readouterr().err


def test_a_warning_is_one_line_naming_the_command(tmp_path):
    """Printed as one line (not Python's two, with a file and line of posenc's), in a process of its own: pytest
    records warnings instead of printing them. Recorders still get every warning, and the format is given back."""
    import subprocess
    import sys

    script = f"""
import warnings
import pytest
from posenc.analysis import plots
from posenc.cli import main

real = plots.FIGURES["wavelengths"]

def warns(inputs):
    warnings.warn("first line\\nsecond line", UserWarning, stacklevel=2)
    return real(inputs)

plots.FIGURES["wavelengths"] = warns
before = warnings.formatwarning
words = ["plot", "wavelengths", "--out", {str(tmp_path)!r}, "--dpi", "30"]
assert main(words) == 0
with pytest.warns(UserWarning, match="first line"):
    assert main(words) == 0
assert warnings.formatwarning is before
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "posenc plot: warning: first line second line\n"


def test_ctrl_c_in_an_import_is_one_line_and_status_130(tmp_path, capsys):
    slow = tmp_path / "slow_import.py"
    slow.write_text("raise KeyboardInterrupt\n")
    assert main(["info", "--import", str(slow)]) == 130
    assert capsys.readouterr().err == "\nposenc info: interrupted; the files written before it are complete\n"


def test_plot_with_a_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"head_dim": 32, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}))
    assert main(["plot", "scaled_frequencies", "--out", str(tmp_path / "out"), "--config", str(config), "--svg"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["scaled_frequencies.png", "scaled_frequencies.svg"]


def test_plot_bad_input(tmp_path, capsys, make_run):
    assert main(["plot", "spiral", "--out", str(tmp_path)]) == 2
    assert "unknown figure(s) 'spiral'" in capsys.readouterr().err
    assert main(["plot", "wavelengths", "--out", str(tmp_path), "--rope-type", "yarn", "--factor", "0.5"]) == 2
    assert "factor" in capsys.readouterr().err and not (tmp_path / "wavelengths.png").exists()
    config = tmp_path / "c.json"
    config.write_text("{}")
    assert main(["plot", "--out", str(tmp_path), "--config", str(config), "--base", "500"]) == 2
    assert "--config already says what to draw; drop --base" in capsys.readouterr().err
    assert main(["plot", "--out", str(tmp_path), "--config", str(config), "--factor", "2"]) == 2
    assert "--config already says what to draw; drop --factor" in capsys.readouterr().err
    assert main(["plot", "attention_entropy", "--out", str(tmp_path), "--run", str(tmp_path)]) == 2
    assert "has no results.csv" in capsys.readouterr().err
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    assert main(["plot", "attention_entropy", "--out", str(tmp_path), "--run", str(run)]) == 2
    assert "has no measured attention entropy" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))
    # The other figures need no measured entropy: they are drawn for the run's model; a folder that is no run is
    # still an error, not the default figures.
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "drawn"), "--run", str(run)]) == 0
    assert (tmp_path / "drawn" / "wavelengths.png").is_file()
    capsys.readouterr()
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "typo"), "--run", str(tmp_path / "no_such_run")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "typo").exists()


@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_scaling_flag_the_rope_type_does_not_read_is_named_as_the_flag(tmp_path, capsys, make_run, command):
    # The parser's own message named a rope_parameters dict and a type 'default' that the user never wrote.
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    words = ["plot", "wavelengths", "--out", str(tmp_path / "out")] if command == "plot" else ["report", str(run)]
    readers_of_factor = ", ".join(
        name for name in frequencies.SCALINGS if "factor" in REQUIRED_KEYS[name] | OPTIONAL_KEYS[name]
    )
    cases = {
        ("--factor", "4"): f"--factor needs a scaling --rope-type (plain RoPE has no factor); add a --rope-type that "
        f"reads it: {readers_of_factor}",
        ("--rope-param", "beta_fast=16"): "--rope-param beta_fast needs a scaling --rope-type (plain RoPE has no "
        "beta_fast); add --rope-type yarn",
        ("--rope-type", "linear", "--rope-param", "beta_fast=16"): "--rope-param beta_fast is not a parameter of "
        "--rope-type linear (it takes factor); drop it, or use --rope-type yarn",
        ("--rope-type", "default", "--factor", "4"): "--factor is not a parameter of --rope-type default (it takes "
        f"no parameters of its own); drop it, or use a --rope-type that reads it: {readers_of_factor}",
        ("--rope-param", "type=linear", "--rope-param", "fator=2"): "--rope-param fator: no rope type reads 'fator'; "
        "check its spelling (rope type 'linear' takes factor)",
        # The last one was kept without a word.
        ("--rope-type", "yarn", "--rope-param", "beta_fast=16", "--rope-param", "beta_fast=64"): "--rope-param "
        "beta_fast is given twice with different values, 16 and 64; keep one",
        ("--rope-type", "yarn", "--rope-param", "beta_slow=1", "--rope-param", "beta_slow=true"): "--rope-param "
        "beta_slow is given twice with different values, 1 and True; keep one",  # 1 == True, yet not the same
    }
    for flags, message in cases.items():
        assert main([*words, *flags]) == 2
        err = capsys.readouterr().err
        assert err == f"posenc {command}: error: {message}\n", flags
    assert not (tmp_path / "out").exists() and not (run / "report.html").exists()
    # Types given twice keep their own message; a key the type reads is drawn.
    assert main([*words, "--rope-type", "yarn", "--factor", "4", "--rope-param", "rope_type=linear"]) == 2
    assert "rope_type is given twice with different values" in capsys.readouterr().err
    if command == "plot":
        assert main([*words, "--rope-param", "rope_type=linear", "--factor", "2"]) == 0
        assert main([*words, "--rope-type", "linear", "--rope-param", "factor=2", "--rope-param", "factor=2.0"]) == 0


def test_a_type_registered_without_its_keys_leaves_the_flag_check_working(tmp_path, capsys, monkeypatch):
    # The check looked up every registered type's keys, and a type in SCALINGS alone was a KeyError traceback.
    monkeypatch.setitem(frequencies.SCALINGS, "brand_new", frequencies.default)
    flags = ["--rope-type", "linear", "--rope-param", "beta_fast=16"]
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err == (
        "posenc plot: error: --rope-param beta_fast is not a parameter of --rope-type linear (it takes factor); drop "
        "it, or use --rope-type yarn\n"
    )
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "out"), "--rope-type", "brand_new"]) == 2
    assert "'brand_new' is registered in SCALINGS" in capsys.readouterr().err
    # A line in REQUIRED_KEYS alone: still the parser's message, not a KeyError from the flag check.
    monkeypatch.setitem(REQUIRED_KEYS, "brand_new", frozenset())
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "out"), "--rope-type", "brand_new", *flags[2:]]) == 2
    assert "'brand_new' is registered in SCALINGS" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plot", "report"])
def test_an_unwritable_out_is_one_error_line(tmp_path, capsys, make_run, command):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    words = ["plot", "wavelengths", "--out", str(blocker / "sub")]
    if command == "report":
        words = ["report", str(run), "--no-figures", "--out", str(blocker / "x.html")]
    assert main(words) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posenc {command}: error: {blocker}") and "Traceback" not in err


def test_report_refuses_figure_options_with_no_figures(tmp_path, capsys, make_run):
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    assert main(["report", str(run), "--no-figures", "--head-dim", "16", "--no-interleaved"]) == 2
    assert capsys.readouterr().err == (
        "posenc report: error: --no-figures leaves out the figures that --head-dim, --no-interleaved describe; drop "
        "one or the other\n"
    )
    assert main(["report", str(run), "--no-figures", "--rope-param", "factor=2"]) == 2
    assert "figures that --rope-param describes;" in capsys.readouterr().err
    assert not (run / "report.html").exists()
    # The figures' reading of results.json is not needed for the tables.
    config = {"dim": 32, "heads": 2, "train_len": 64, "eval_lengths": [64, 128]}
    (run / "results.json").write_text(json.dumps({"config": config, "rope": {"head_dim": 16}}))
    assert main(["report", str(run)]) == 2 and "results.json" in capsys.readouterr().err
    assert main(["report", str(run), "--no-figures"]) == 0


def test_report_refuses_a_results_csv_changed_by_hand_naming_the_line(tmp_path, capsys, make_run):
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    lines = (run / "results.csv").read_text().splitlines()
    # A row twice was counted as two seeds ("6.7424 ± 0.0000").
    (run / "results.csv").write_text("\n".join([*lines, lines[1]]) + "\n")
    assert main(["report", str(run), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert f"lines 2 and {len(lines) + 1}, measure the same model at the same length and seed" in err
    # A length that is no number: float's "could not convert string to float: 'xx'" named no file or line.
    header = lines[0].split(",")
    cells = lines[1].split(",")
    cells[header.index("eval_len")] = "xx"
    (run / "results.csv").write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert main(["report", str(run), "--no-figures"]) == 2
    assert "results.csv, line 2: eval_len is 'xx', not a whole number" in capsys.readouterr().err


def test_report(tmp_path, capsys, make_run):
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    assert main(["report", str(run), "--no-figures"]) == 0
    assert (run / "report.html").is_file() and capsys.readouterr().out.strip() == str(run / "report.html")
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "has no results.csv" in capsys.readouterr().err


@pytest.mark.skipif(lock.fcntl is None, reason="the lab's folder lock is POSIX flock")
def test_a_folder_a_lab_run_is_writing_is_said_to_be(tmp_path, capsys, make_run, hold_folder):
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    proc = hold_folder(run)
    running = f"a posenc lab run (pid {proc.pid} on "
    assert main(["report", str(run), "--no-figures"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"posenc report: note: {running}") and "its results.csv was last written at" in err
    assert f'<p class="note">As this page was written: {running}' in (run / "report.html").read_text()
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "figures"), "--run", str(run)]) == 0
    assert f"posenc plot: note: {running}" in capsys.readouterr().err
    # A first run with no results yet: not "stopped before writing results.csv; rerun", which would be refused.
    first = tmp_path / "first"
    first.mkdir()
    (first / "config.json").write_text("{}")
    hold_folder(first)
    assert main(["report", str(first)]) == 2
    err = capsys.readouterr().err
    assert f"run folder {str(first)!r} has no results yet: a posenc lab run (pid" in err
    assert f"is writing {first} now; it writes results.csv and report.html when it finishes" in err
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "figures"), "--run", str(first)]) == 0
    assert "posenc plot: note: a posenc lab run (pid" in (err := capsys.readouterr().err)
    assert "it writes results.csv and report.html when it finishes" in err
    proc.kill()
    proc.wait()
    assert main(["report", str(run), "--no-figures"]) == 0
    assert "note" not in capsys.readouterr().err and 'class="note"' not in (run / "report.html").read_text()


def test_the_report_looks_at_the_lock_once_so_its_page_and_stderr_agree(tmp_path, capsys, make_run, monkeypatch):
    # A run that ends while the page renders: a second look would find no holder, and the two would disagree.
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    answers = iter(["a posenc lab run (pid 42 on vm)"])
    monkeypatch.setattr("posenc.analysis.run.holder", lambda folder: next(answers, None))
    assert main(["report", str(run), "--no-figures"]) == 0
    assert capsys.readouterr().err.startswith("posenc report: note: a posenc lab run (pid 42 on vm) is writing")
    assert (
        '<p class="note">As this page was written: a posenc lab run (pid 42 on vm)' in (run / "report.html").read_text()
    )


def test_the_reports_plot_command_reproduces_its_config(tmp_path):
    import shlex

    from posenc.analysis import FigureConfig
    from posenc.analysis.report import plot_command
    from posenc.cli import _figure_config, build_parser

    params = {"rope_type": "longrope", "rope_theta": 1234567.0, "factor": 4.0}  # :g would print 1.23457e+06
    params |= {"short_factor": [1.0] * 8, "long_factor": [1.0 + i / 4 for i in range(8)]}
    config = FigureConfig(head_dim=16, rope_parameters=params, train_len=128, num_heads=2)
    args = build_parser().parse_args(shlex.split(plot_command(config, tmp_path / "my run"))[1:])
    assert _figure_config(args) == config and args.run == str(tmp_path / "my run")
    # Adjacent pairs (a DeepSeek-style config) survive the round trip: figure 1 draws channels 2 and 3 for them.
    adjacent = FigureConfig(head_dim=16, train_len=128, num_heads=2, interleaved=True)
    assert _figure_config(build_parser().parse_args(shlex.split(plot_command(adjacent))[1:])) == adjacent
    # Split halves for a run whose model had adjacent pairs: --run alone would fill those in again.
    run = tmp_path / "adjacent run"
    run.mkdir()
    sizes = {"dim": 32, "heads": 2, "train_len": 128, "eval_lengths": [128, 512]}
    rope = {"head_dim": 16, "rotary_dim": 16, "interleaved": True, "rope_parameters": {"rope_type": "default"}}
    (run / "results.json").write_text(json.dumps({"config": sizes, "rope": rope}))
    halves = FigureConfig(head_dim=16, train_len=128, num_heads=2)
    command = plot_command(halves, run)
    assert "--no-interleaved" in command and "--no-interleaved" not in plot_command(halves, tmp_path / "my run")
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert _figure_config(args, args.run).interleaved is False


def test_figure_options_name_each_value_once_and_keep_the_runs_sizes(tmp_path, capsys, make_run):
    from posenc.analysis.run import run_figure_config
    from posenc.cli import _figure_config, build_parser

    def config(*words: str, run: str | None = None):
        return _figure_config(build_parser().parse_args(["plot", "--out", str(tmp_path), *words]), run)

    assert main(["plot", "--out", str(tmp_path), "--rope-type", "yarn", "--factor", "4", "--rope-param", "factor=8"])
    assert "factor is given twice with different values" in capsys.readouterr().err
    assert config("--rope-type", "yarn", "--factor", "4", "--rope-param", "factor=4").spec.params["factor"] == 4.0
    # A scaling's original length is the figures' L, with --run too (the run's own L would contradict it).
    run = make_run(tmp_path / "with_original", entropy=False, lab_png=False)
    words = ("--rope-type", "yarn", "--rope-param", "original_max_position_embeddings=4096")
    assert config(*words, run=str(run)).train_len == 4096
    # The legacy key names the type: no rope_type 'default' added beside it.
    assert config("--rope-param", "type=linear", "--rope-param", "factor=2").rope_type == "linear"
    # A head of one pair: the figures leave out the types that need four channels (ntk, dynamic).
    assert main(["plot", "scaled_frequencies", "--out", str(tmp_path / "small"), "--head-dim", "2"]) == 0
    # Options over a run change what they name; sizes they leave out stay the run's.
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    sizes = {"dim": 32, "heads": 2, "train_len": 16, "eval_lengths": [16, 32, 128]}
    (run / "results.json").write_text(json.dumps({"config": sizes}))
    own = run_figure_config(run)
    assert own is not None and (own.head_dim, own.eval_len) == (16, 128)
    scaled = config("--rope-type", "linear", "--factor", "2", run=str(run))
    assert (scaled.head_dim, scaled.train_len, scaled.eval_len, scaled.num_heads) == (
        own.head_dim,
        own.train_len,
        own.eval_len,
        own.num_heads,
    )
    assert config("--train-len", "64", run=str(run)).eval_len == 256
    # The RoPE a run trained with (an --hf-config model's theta, rotary fraction, layout) stays under the options.
    rope = {"head_dim": 16, "rotary_dim": 4, "interleaved": True}
    rope["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (run / "results.json").write_text(json.dumps({"config": sizes, "rope": rope}))
    own = run_figure_config(run)
    assert (own.base, own.spec.rotary_dim, own.interleaved) == (500000.0, 4, True)
    scaled = config("--rope-type", "linear", "--factor", "2", run=str(run))
    assert (scaled.base, scaled.spec.rotary_dim, scaled.interleaved, scaled.rope_type) == (500000.0, 4, True, "linear")
    assert config("--base", "1e4", run=str(run)).base == 1e4  # what is given wins
    assert config("--no-interleaved", run=str(run)).interleaved is False  # split halves for an adjacent-pairs run
    assert config("--no-interleaved").interleaved is False and config("--interleaved").interleaved is True


@pytest.mark.parametrize("command", ["plot", "report"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, capsys, make_run, monkeypatch, command):
    from posenc.analysis import plots

    def interrupted(inputs):
        raise KeyboardInterrupt

    monkeypatch.setitem(plots.FIGURES, "long_term_decay", interrupted)  # the report's table too
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    words = ["plot", "wavelengths", "long_term_decay", "--dpi", "30", "--out", str(tmp_path / "figures")]
    if command == "report":
        words = ["report", str(run)]
    assert main(words) == 130
    err = capsys.readouterr().err
    assert err == f"\nposenc {command}: interrupted; the files written before it are complete\n"
    if command == "plot":
        assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["wavelengths.png"]
    else:
        assert not (run / "report.html").exists()


def test_plot_draws_a_layer_type_of_a_config_with_one_rope_dict_per_layer_type(tmp_path, capsys):
    config = tmp_path / "config.json"
    layer_types = ["sliding_attention", "full_attention"]
    thetas = {"sliding_attention": 1e4, "full_attention": 1e6}
    rope = {kind: {"rope_type": "default", "rope_theta": theta} for kind, theta in thetas.items()}
    gemma3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 2, "head_dim": 32}
    gemma3["num_hidden_layers"] = len(layer_types)
    config.write_text(json.dumps({**gemma3, "layer_types": layer_types, "rope_parameters": rope}))
    words = ["plot", "wavelengths", "--out", str(tmp_path / "out"), "--config", str(config)]
    assert main(words) == 2
    assert "--layer-type full_attention" in capsys.readouterr().err
    assert main([*words, "--layer-type", "full_attention"]) == 0
    assert (tmp_path / "out" / "wavelengths.png").exists()
    assert main(["plot", "wavelengths", "--out", str(tmp_path / "out"), "--layer-type", "full_attention"]) == 2
    assert "give --config" in capsys.readouterr().err
