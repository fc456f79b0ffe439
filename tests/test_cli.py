"""The `rolerl` command with a new user's mistakes: each gets one line naming the file, field or flag and
what to do, exit code 2, and no traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rolerl.cli import build_parser, main

TINY = ["--set", "model.spec=tiny:llama", "train.steps=1", "rollout.n=2", "rollout.max_new_tokens=4",
        "train.tasks_per_step=1", "run.progress=false", "run.tensorboard=false", "train.bf16=false"]  # fmt: skip


def one_line_error(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert lines[-1].startswith(f"rolerl {argv[0]}: error: "), err
    for text in expected:
        assert text in lines[-1], lines[-1]
    return lines[-1]


def test_malformed_yaml_names_the_file_and_the_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train:\n  steps: 2\n  micro_batch_size: [4\nrun:\n  seed: 1\n")
    one_line_error(capsys, ["train", str(cfg)], str(cfg), "not valid YAML", "line 4")


def test_override_that_is_not_yaml(capsys):
    one_line_error(capsys, ["train", "smoke", "--set", "train.steps=[1"],
                   "train.steps=[1", "not valid YAML")  # fmt: skip


def test_config_path_that_is_a_directory_or_missing(tmp_path, capsys):
    one_line_error(capsys, ["train", str(tmp_path)], "is a directory")
    one_line_error(capsys, ["sft", str(tmp_path / "nope.yaml"), "--data", "x.jsonl"], "does not exist")


def test_unknown_field_and_bad_choice_name_the_field(capsys):
    one_line_error(capsys, ["train", "smoke", "--set", "train.stepz=3"], "did you mean 'train.steps'")
    one_line_error(capsys, ["train", "smoke", "--set", "adapters.preset=joint"],
                   "adapters.preset='joint'", "allowed")  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_cpu_only_torch(tmp_path, capsys):
    argv = ["train", "smoke", *TINY, f"run.dir={tmp_path / 'r'}", "model.device=cuda"]
    one_line_error(capsys, argv, "model.device='cuda'", "no CUDA device")


def test_flag_before_the_config_path_works(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--set", f"run.dir={run}", "rollout.tool=none", *TINY[1:], "smoke"]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["run_dir"] == str(run)
    assert (run / "checkpoints" / "step_1").is_dir()


@pytest.mark.parametrize("command", ["demo", "train", "sft"])
def test_repeated_set_flags_add_up(command):
    """`--set a=1 --set b=2` keeps both (argparse's default would keep only the last, silently)."""
    parsed = build_parser().parse_args(
        [command, "--set", "train.steps=3", "optim.lr=1", "--set", "run.seed=2"]
    )
    overrides = parsed.set if command == "demo" else parsed.overrides
    assert overrides == ["train.steps=3", "optim.lr=1", "run.seed=2"]


def test_an_override_without_equals_sign_says_what_an_override_looks_like(capsys):
    one_line_error(capsys, ["train", "smoke", "--set", "train.steps"], "section.field=value")


def test_generate_help_gives_every_default():
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for flag in ("--temperature", "--top-p", "--top-k", "--seed", "--max-len", "--dtype"):
        assert flag in help_text
    assert help_text.count("default") >= 7


def test_generate_colours_by_kind_and_lists_each_kinds_route(capsys):
    argv = ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "6", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("[kinds: reasoning 6 (base)") and out[-1].startswith("[6 tokens, length")
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["kinds"] == ["reasoning"] * 6 and len(result["routes"]) == 6


@pytest.mark.parametrize("style", ["xml", "markdown"])
def test_generate_tag_styles_are_valid_tags(style):
    from rolerl.cli import TOOL_SYSTEM, TOOL_TAGS
    from rolerl.roles import Tags

    tags = Tags(*TOOL_TAGS[style])
    assert tags.tool_open.strip("\n<`") in TOOL_SYSTEM[style]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the Python sandbox needs root (CI runs as root)")
def test_the_readmes_first_generate_command_calls_the_tool(capsys):
    """README: `rolerl generate --prompt "What is 2**20? Use python." --tools python --greedy` on the
    default model writes a tool call, and the sandbox's output is spliced in."""
    argv = ["generate", "--prompt", "What is 2**20? Use python.", "--tools", "python", "--greedy",
            "--dtype", "float32", "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["tool_calls"] and "1048576" in result["tool_calls"][0]["output"]
    assert "tool_call" in result["kinds"] and "tool_output" in result["kinds"]


def test_model_names_are_ids_not_cache_paths(tmp_path):
    from rolerl.models.load import DEFAULT_MODEL_ID, model_name

    assert model_name("default") == DEFAULT_MODEL_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_name(str(tmp_path)) == str(tmp_path.resolve())
    assert model_name("weights/m.gguf") == str(Path("weights/m.gguf").resolve())


@pytest.mark.slow
def test_adapters_command_records_the_base_models_id(tmp_path, capsys):
    assert main(["adapters", "--names", "reason", "tool", "--rank", "4", "--out", str(tmp_path)]) == 0
    for name in ("reason", "tool"):
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_garbage_adapter_file_and_an_adapter_for_another_model(tmp_path, capsys, tokenizer):
    from transformers import AutoModelForCausalLM

    import rolerl
    from rolerl.models.tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer), intermediate_size=96))
    rolerl.add_adapters(model, ["a"], rank=2)
    rolerl.save_adapter(model, "a", tmp_path / "other")
    argv = ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "2", "--adapter"]
    one_line_error(capsys, [*argv, str(tmp_path / "other")], "was made for another base model")
    (tmp_path / "other" / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    one_line_error(capsys, [*argv, str(tmp_path / "other")], "adapter_model.safetensors", "not a readable")


def test_sft_row_that_is_not_a_string_names_the_file_line_and_field(tmp_path, capsys):
    data = tmp_path / "demos.jsonl"
    good = {"role": "policy", "messages": [{"role": "user", "content": "hi"}]}
    bad = {"role": "policy", "messages": [{"role": "user", "content": ["hi", "there"]}]}
    data.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    argv = ["sft", "smoke", "--data", str(data), "--set", "model.spec=tiny:llama",
            f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    one_line_error(capsys, argv, f"{data}:5", "messages[0].content must be a string")


def test_no_progress_silences_the_libraries_bars(tmp_path, monkeypatch, capsys):
    """transformers' "Loading weights" bar wrote its frames into `--no-progress` logs: the flag now turns off
    the bars of a transformers already imported and, through the hub's variable, of one imported later."""
    import subprocess
    import sys

    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        missing = ["demos", "gsm8k", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "d.jsonl")]
        assert main([*missing, "--no-progress"]) == 2  # the flag acts before the command runs, or fails
        capsys.readouterr()
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        assert "Loading weights" not in capsys.readouterr().err
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        hf_logging.enable_progress_bar()
    later = (  # a fresh process: the flag acts before transformers is imported
        "import sys; from rolerl.cli import _no_library_bars; assert 'transformers' not in sys.modules; "
        "_no_library_bars(); from transformers.utils import logging; print(logging.is_progress_bar_enabled())"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", later], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    hub_first = (  # the hub in use without transformers (which would pass the word on): told directly
        "import sys; import huggingface_hub.utils as hub; assert not hub.are_progress_bars_disabled(); "
        "from rolerl.cli import _no_library_bars; assert 'transformers' not in sys.modules; _no_library_bars(); "
        "print(hub.are_progress_bars_disabled())"
    )
    out = subprocess.run(
        [sys.executable, "-c", hub_first], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
