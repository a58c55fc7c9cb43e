"""The headless main job, `colab-kit demo`, end to end on 2 local ranks."""
import subprocess
import sys

import pytest

import colab_kit as ck
from colab_kit import cli


def test_demo_trains_reports_and_matches_one_process(tmp_path):
    # a real process, as a user runs it: the ranks print the per-step lines to its stdout
    report = tmp_path / "report.html"
    run = subprocess.run([sys.executable, "-m", "colab_kit.cli", "demo", "--ranks", "2", "--steps", "6",
                          "--batch", "8", "--report", str(report)], capture_output=True, text=True, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "dp=2 = 2 ranks" in out
    assert out.count("loss ") >= 6  # one line per step
    assert "step   6/6" in out
    assert "memory per rank" in out and "activations" in out
    assert "max relative loss difference" in out and "(OK, contract 1e-5)" in out
    assert "grad norm" in out and "lr " in out  # the recipe's clipping and schedule, step by step
    assert "unigram entropy" in out and "held out" in out
    assert "tokens/s" in out and "MFU" in out and "measured peak" in out
    assert "sample (temperature 0.8) after 'def '" in out
    html = report.read_text()
    # five plotly figures: mesh, loss, norm and lr, memory, timeline; plotly.js embedded once (opens offline)
    assert html.count("Plotly.newPlot") == 5
    assert "Training loss" in html and "Memory per rank" in html and "Gradient norm and learning rate" in html


def test_demo_text_learns_below_the_unigram_entropy(tmp_path):
    """The default recipe on the standard library's text: 40 steps of dp=2 already take the loss below what
    byte frequencies alone give, and the one-process check holds."""
    import io
    out = io.StringIO()
    got = cli.demo(ranks=2, steps=40, batch=16, report="", out=out)
    first = got["results"][0]
    assert first["losses"][-1] < first["unigram"] < first["losses"][0], out.getvalue()
    norms = [r["grad_norm"] for r in first["records"]]
    assert max(norms) > cli.MAX_GRAD_NORM  # the first steps were clipped
    lrs = [r["lr"] for r in first["records"]]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warmup, then decay
    assert "(OK, contract 1e-5)" in out.getvalue()


def test_demo_rejects_batch_that_does_not_split(capsys):
    assert cli.main(["demo", "--ranks", "3", "--batch", "8", "--steps", "1", "--report", ""]) == 2
    assert "--batch 8 does not split over 3 ranks" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "colab_kit.cli", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--ranks" in out.stdout


def test_demo_any_config_saves_and_resumes_under_another(tmp_path):
    """tp=2 for 3 steps, saved; resumed under pp=2 for 2 more: the 5 losses match one process's 5."""
    import io

    ckpt, report = str(tmp_path / "ck"), tmp_path / "r.html"
    first = io.StringIO()
    cli.demo(steps=3, batch=8, report="", out=first, config="tp=2", save=ckpt)
    assert "tp=2 (1d) = 2 ranks" in first.getvalue() and f"checkpoint of step 3 saved to {ckpt}" in first.getvalue()
    assert "(OK, contract 1e-5)" in first.getvalue()
    second = io.StringIO()
    got = cli.demo(steps=2, batch=8, report=str(report), out=second, config="pp=2", resume=ckpt)
    text = second.getvalue()
    assert f"2 steps after the 3 steps of {ckpt}" in text
    assert "for all 5 steps" in text and "(OK, contract 1e-5)" in text, text
    assert len(got["results"][0]["losses"]) == 5 and got["results"][0]["start"] == 3
    html = report.read_text()
    assert "pp=2" in html and "coloured by pp group" in html and "Memory per rank" in html


def test_demo_config_refusals(capsys):
    assert cli.main(["demo", "--config", "dp=2 tp=2", "--ranks", "2", "--steps", "1", "--report", ""]) == 2
    assert "runs on 4 ranks, not --ranks 2" in capsys.readouterr().err
    assert cli.main(["demo", "--config", "dp=2", "--batch", "5", "--steps", "1", "--report", ""]) == 2
    assert "--batch 5 does not split over dp=2 x microbatches=1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], "--steps 0: the demo trains at least 1 step"),
    (["--ranks", "0"], "--ranks 0: the demo runs on at least 1 rank"),
    (["--batch", "0"], "--batch 0: a batch holds at least 1 row per rank"),
    (["--lr", "-1"], "--lr -1.0: a learning rate is a number > 0"),
    (["--config", "tp=3"], "tp=3 does not divide the model's 4 attention heads"),
    (["--resume", "/nonexistent/ck"], "--resume /nonexistent/ck: no such file or directory"),
    (["--text", "/nonexistent/corpus"], "--text /nonexistent/corpus: no such file or directory"),
])
def test_demo_refuses_bad_flags_before_any_rank_starts(flags, words, capsys, monkeypatch):
    """Each refused in the parent, naming the flag (before: after every rank started, the error printed once per
    rank with a traceback, or a crash: --steps 1 failed in the LR schedule's warmup)."""
    monkeypatch.setattr(ck, "launch", lambda *a, **k: pytest.fail("no rank may start"))
    assert cli.main(["demo", *flags, "--report", ""]) == 2
    assert words in capsys.readouterr().err


def test_demo_refuses_to_save_over_a_folder_of_the_users(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ck, "launch", lambda *a, **k: pytest.fail("no rank may start"))
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--save", str(tmp_path), "--report", ""]) == 2
    assert "is a directory that is not a colab_kit checkpoint (it holds notes.txt)" in capsys.readouterr().err
