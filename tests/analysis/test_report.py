"""report.html: the lab's tables and plots plus the figures, self-contained, checked in headless Chromium."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from posenc.analysis import FigureConfig, write_report
from posenc.analysis.report import read_results, summary_table


def test_summary_table_by_hand(tmp_path, make_run):
    """n/a: measured, no value (learned past its table has a row and a reason); blank: never run at that length
    (an extension at the training length has no row), as report.md leaves it."""
    header, body = summary_table(read_results(make_run(tmp_path / "run", entropy=False, lab_png=False)))
    assert header == ["encoding", "extension", "train_len", "bpb @ 64", "bpb @ 128"]
    assert body == [
        ["rope", "none", "64", "2.6000 ± 0.1414", "3.1000 (1 of 2 seeds)"],
        ["rope", "yarn", "64", "", "2.6000 (1 of 2 seeds)"],
        ["learned", "none", "64", "2.8000 (1 of 2 seeds)", "n/a"],
    ]


def test_a_value_over_fewer_seeds_than_the_file_holds_says_so():
    # Seed 1's rope row at 128 is missing (a folder put together by hand, or cut short): its value is seed 0's
    # alone and the mean at 64 is over both, which the cells must tell apart.
    common = {"encoding": "rope", "extension": "none", "train_len": "64"}
    rows = [
        {**common, "eval_len": "64", "seed": "0", "bits_per_byte": "2.0"},
        {**common, "eval_len": "64", "seed": "1", "bits_per_byte": "3.0"},
        {**common, "eval_len": "128", "seed": "0", "bits_per_byte": "4.0"},
        {**common, "eval_len": "128", "seed": "1", "bits_per_byte": "nan"},
    ]
    assert summary_table(rows)[1] == [["rope", "none", "64", "2.5000 ± 0.7071", "4.0000 (1 of 2 seeds)"]]
    assert summary_table(rows[:3])[1] == [["rope", "none", "64", "2.5000 ± 0.7071", "4.0000 (1 of 2 seeds)"]]


def test_the_summary_explains_n_a_and_blank_cells_as_they_are(tmp_path, make_run):
    page = write_report(make_run(tmp_path / "run", entropy=False, lab_png=False), figures=[]).read_text()
    summary = page.split("<h2>Bits per byte by evaluation length</h2>", 1)[1].split("<details>", 1)[0]
    assert "see the full rows below for the reason" not in summary
    assert "blank where it was not run at that length" in summary
    assert "<td>rope</td><td>yarn</td><td>64</td><td></td><td>2.6000 (1 of 2 seeds)</td>" in summary


def test_report_holds_tables_and_embedded_images(tmp_path, make_run):
    run = make_run(tmp_path / "run")
    path = write_report(run, figures=["wavelengths", "attention_entropy"], config=FigureConfig(head_dim=32))
    assert path == run / "report.html"
    page = path.read_text()
    assert "2.6000 ± 0.1414" in page and "past the learned table" in page and "corpus_sha256" in page
    assert "rope &lt;b&gt;" in page  # the lab's markdown is escaped, never injected
    sources = re.findall(r'<img [^>]*src="([^"]*)"', page)
    assert len(sources) == 3  # the lab's PNG and two figures
    for source in sources:
        assert source.startswith("data:image/png;base64,")
        assert base64.b64decode(source.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    # Nothing is fetched from anywhere: no external references at all.
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page
    assert "attention_entropy: " in page and "measured in run/entropy.csv" in page


def test_captions_hold_the_whole_first_paragraph(tmp_path, make_run):
    """A docstring's first paragraph that wraps over lines is the caption whole, not cut at its first line."""
    page = write_report(make_run(tmp_path / "run", entropy=False, lab_png=False), figures=["mrope_layouts"]).read_text()
    (caption,) = re.findall(r"<figcaption>(.*?)</figcaption>", page, flags=re.S)
    assert caption.startswith("mrope_layouts: Which position axis turns each frequency pair")
    assert caption.endswith("ERNIE&#x27;s alternation gives height and width the fast pairs and time the slow ones.")
    assert "\n" not in caption and "  " not in caption


def test_report_without_figures_and_custom_out(tmp_path, make_run):
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    path = write_report(run, out=tmp_path / "pages" / "r.html", figures=[])
    assert path.is_file() and "<img" not in path.read_text()
    assert not list(run.glob(".report.html.*"))  # no temporary file left behind


def test_bad_run_folders_are_clear_errors(tmp_path, make_run):
    with pytest.raises(ValueError, match="does not exist"):
        write_report(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(ValueError, match=r"notes\.txt' is a file, not a run folder"):
        write_report(tmp_path / "notes.txt")
    assert not (tmp_path / "notes.txt" / "report.html").exists() and (tmp_path / "notes.txt").read_text() == "not a run"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no results\.csv \(no finished measurements\)"):
        write_report(tmp_path / "empty")
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "results.csv").write_text("encoding,bpb\nrope,2.5\n")
    with pytest.raises(ValueError, match="lacks the column\\(s\\) extension, train_len, eval_len, seed, bits_per_byte"):
        write_report(tmp_path / "wrong")
    (tmp_path / "header").mkdir()
    (tmp_path / "header" / "results.csv").write_text("encoding,extension,train_len,eval_len,seed,bits_per_byte\n")
    with pytest.raises(ValueError, match="has a header but no rows"):
        write_report(tmp_path / "header")
    run = make_run(tmp_path / "run", entropy=False, lab_png=False)
    with pytest.raises(ValueError, match="unknown figure"):
        write_report(run, figures=["spiral"])
    with pytest.raises(ValueError, match="is a directory"):
        write_report(run, out=tmp_path, figures=[])


@pytest.mark.parametrize("cut", ["3.7945", "3.7945345,True,", "3.7945345,True,,2.9,[2.9],,,,128,extra"])
def test_a_results_csv_cut_short_mid_row_is_refused(tmp_path, cut):
    """A results.csv cut short by a partial copy gave a report whose last value was the cut one (3.7945 for
    3.7945345...), the cells after it empty; a row of more cells than the header, too, is no row the lab wrote."""
    header = "encoding,extension,train_len,eval_len,seed,bits_per_byte,applicable,reason,entropy,entropy_by_layer"
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text(f"{header}\nrope,none,16,16,0,3.8,True,,2.9,[2.9]\nalibi,none,16,16,0,{cut}")
    with pytest.raises(ValueError, match=r"results\.csv, line 3, has \d+ cells where the header names 10: it was cut"):
        read_results(run)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Counts the images that decoded (naturalWidth > 0) once the page has loaded, and writes it into the DOM.
_PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const ok = images.filter((img) => img.complete && img.naturalWidth > 0).length;
  document.body.setAttribute("data-images", ok + "/" + images.length);
});
</script>"""


def render_in_chromium(chromium: str, page: str, folder: Path) -> tuple[int, int, list[str]]:
    """Load ``page`` (plus the probe) headless. Returns (images loaded, images, console lines)."""
    folder.mkdir()
    probed = folder / "probed.html"
    probed.write_text(page.replace("</body>", _PROBE + "</body>"))
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={folder / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        probed.as_uri(),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"chromium at {chromium} could not run here: {err}")
    if done.returncode != 0 and "<body" not in done.stdout:
        pytest.skip(f"chromium at {chromium} exited {done.returncode} without a page: {done.stderr[-500:]}")
    match = re.search(r'data-images="(\d+)/(\d+)"', done.stdout)
    assert match, "the load probe did not run: " + done.stderr[-1000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return int(match.group(1)), int(match.group(2)), console


def test_report_renders_in_headless_chromium(tmp_path, make_run):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH (.ci/run installs Debian's `chromium`); cannot render report.html")
    # The check can fail: a page with one broken image and one console error is caught.
    broken = '<html><body><img src="data:image/png;base64,AAAA"><script>console.error("x")</script></body></html>'
    loaded, total, console = render_in_chromium(chromium, broken, tmp_path / "control")
    assert (loaded, total) == (0, 1) and len(console) == 1

    run = make_run(tmp_path / "run")
    page = write_report(run).read_text()  # every figure, as `posenc report` writes it; the probe goes in a copy
    loaded, total, console = render_in_chromium(chromium, page, tmp_path / "report")
    from posenc.analysis import FIGURES

    assert total == 1 + len(FIGURES) and loaded == total, f"{loaded} of {total} images loaded"  # the lab's PNG too
    assert not console, console


def test_finetuned_models_are_their_own_rows():
    common = {"encoding": "rope", "extension": "pi", "train_len": "64", "eval_len": "128", "seed": "0"}
    rows = [
        {**common, "finetune_steps": "0", "bits_per_byte": "4.0"},
        {**common, "finetune_steps": "200", "bits_per_byte": "2.0"},
    ]
    header, body = summary_table(rows)
    assert header == ["encoding", "extension", "finetune_steps", "train_len", "bpb @ 128"]
    assert body == [["rope", "pi", "0", "64", "4.0000"], ["rope", "pi", "200", "64", "2.0000"]]
