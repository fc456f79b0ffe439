"""The example configs ship inside the package and every command that takes a CONFIG finds them by name;
`rolerl configs list/show/copy`; a file of the same name wins over an example."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolerl import configs
from rolerl.cli import main
from rolerl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["demo", "eval-opt", "gsm8k-msarl", "gsm8k-tir", "msarl", "orch-workers", "search-agent", "smoke",
            "voting"]  # fmt: skip


def test_every_example_is_in_the_package_and_valid():
    assert configs.names() == EXAMPLES
    assert configs.DIR == ROOT / "rolerl" / "configs"
    for name in EXAMPLES:
        cfg = load_config(name)
        assert load_config(f"{name}.yaml") == cfg == load_config(configs.DIR / f"{name}.yaml")
        assert configs.describe(name).endswith(".") and "\n" not in configs.describe(name)
    assert load_config("voting").task.workflow == "voting"
    assert load_config("search-agent").adapters.preset == "dart"


def test_a_file_in_the_working_directory_wins_over_an_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").write_text("train:\n  steps: 7\n")
    assert load_config("smoke").train.steps == 7
    assert load_config("smoke.yaml").train.steps == 2  # no file of that name here: the example


def test_an_old_path_or_an_unknown_name_says_what_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"rolerl ships it as an example: give its name, 'voting'"):
        load_config("configs/voting.yaml")
    with pytest.raises(
        ConfigError, match=r"does not exist; give a YAML file or the name .*eval-opt, gsm8k-msarl"
    ):
        load_config("votin")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_configs_list_show_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["configs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == EXAMPLES
    assert main(["configs", "show", "voting"]) == 0
    assert capsys.readouterr().out == (configs.DIR / "voting.yaml").read_text()
    assert main(["configs", "copy", "voting"]) == 0
    assert (tmp_path / "voting.yaml").read_text() == (configs.DIR / "voting.yaml").read_text()
    assert main(["configs", "copy", "voting"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    assert main(["configs", "copy", "smoke.yaml", "mine"]) == 0  # a directory: NAME.yaml in it
    assert (tmp_path / "mine" / "smoke.yaml").is_file()
    assert main(["configs", "copy", "smoke", "mine/smoke.yaml", "--force"]) == 0
    assert main(["configs", "show", "nope"]) == 2
    assert "no example config named 'nope'; the examples: demo, eval-opt" in capsys.readouterr().err


def test_train_takes_an_example_name_before_or_after_set(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny = ["model.spec=tiny:llama", "train.steps=1", "rollout.n=2", "rollout.max_new_tokens=4",
            "train.tasks_per_step=1", "run.progress=false", "run.tensorboard=false", "train.bf16=false"]  # fmt: skip
    assert main(["train", "smoke", "--set", *tiny, "run.dir=a"]) == 0
    assert main(["train", "--set", *tiny, "run.dir=b", "smoke"]) == 0
    for run in ("a", "b"):
        assert load_config(tmp_path / run / "config.yaml").task.name == "arithmetic_lenient"
