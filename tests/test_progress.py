"""Progress in a file or a pipe: plain lines, rate-limited, no control codes or blank lines."""

from __future__ import annotations

from rolerl.progress import ProgressBar


def test_progress_to_a_file_is_plain_rate_limited_lines(capsys):
    with ProgressBar("train", 3, every_s=0.0, idle_s=3600) as bar:  # stderr is captured: not a terminal
        bar.update(0, "rollout: 10 tokens sampled")  # a description alone: within idle_s, no line
        bar.update(1, "reward 0.1")
        bar.update(2, "reward 0.2")
        bar.update(3, "reward 0.3")
    err = capsys.readouterr().err
    assert err.splitlines() == ["train 1/3 reward 0.1", "train 2/3 reward 0.2", "train 3/3 reward 0.3"]
    assert "\x1b" not in err and "\n\n" not in err


def test_progress_lines_wait_for_every_s_except_the_last(capsys):
    with ProgressBar("eval", 100, every_s=3600) as bar:
        for done in range(1, 101):
            bar.update(done)
    assert capsys.readouterr().err.splitlines() == ["eval 100/100"]


def test_disabled_progress_prints_nothing(capsys):
    with ProgressBar("train", 2, enabled=False) as bar:
        bar.update(1, "x")
    assert capsys.readouterr().err == ""
