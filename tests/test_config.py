"""Config loading: YAML + overrides with type coercion, and errors that name the field and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from rolerl.config import Config, ConfigError, config_reference, load_config


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert cfg == Config()
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_yaml_and_overrides_with_type_coercion(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-4\ntrain:\n  steps: 3\nrun:\n  tensorboard: false\n")
    cfg = load_config(
        path,
        [
            "train.steps=7",  # override beats the file
            "algorithm.clip_c=3",  # int -> float for a `float | None` field
            "algorithm.tis_cap=2.0",
            "algorithm.old_logp=recompute",
            "adapters.target_modules=[q_proj, v_proj]",  # a YAML list
            "adapters.alpha=null",
            "optim.warmup_steps=2.0",  # an integral float is an int
        ],
    )
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 1e-4 as a string
    assert cfg.train.steps == 7 and cfg.run.tensorboard is False
    assert cfg.algorithm.clip_c == 3.0 and isinstance(cfg.algorithm.clip_c, float)
    assert cfg.adapters.target_modules == ["q_proj", "v_proj"] and cfg.adapters.alpha is None
    assert cfg.optim.warmup_steps == 2 and isinstance(cfg.optim.warmup_steps, int)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], r"unknown key 'train.stepz'; did you mean 'train.steps'\?"),
        (["trian.steps=3"], r"unknown key 'trian'; did you mean 'train'\?"),
        (["algorithm.lossagg=token-mean"], r"did you mean 'algorithm.loss_agg'\?"),
        (["train.steps=abc"], r"train.steps='abc'; expected an integer"),
        (["train.steps=1.5"], r"train.steps=1.5; expected an integer"),
        (["run.tensorboard=maybe"], r"run.tensorboard='maybe'; expected true/false"),
        (["algorithm.clip_c=big"], r"algorithm.clip_c='big'; expected a number or null"),
        (["optim.betas=0.9"], r"optim.betas=0.9; expected a list of a number"),
        (["algorithm.advantage=ppo"], r"algorithm.advantage='ppo'; allowed: \['grpo', 'dr_grpo', 'rloo'\]"),
        (
            ["algorithm.loss_agg=mean"],
            r"algorithm.loss_agg='mean'; allowed: \['token-mean', 'seq-mean-token-mean'",
        ),
        (
            ["adapters.preset=mixed"],
            r"adapters.preset='mixed'; allowed: \['shared', 'dart', 'isolated', 'masked', 'separate', 'custom', 'none'\]",
        ),
        (["train.steps=0"], r"train.steps=0; allowed: an integer >= 1"),
        (["task.max_difficulty=0"], r"task.max_difficulty=0; allowed: null or an integer >= 1"),
        (["optim.lr=-1"], r"optim.lr=-1.0; allowed: a number > 0"),
        (["algorithm.clip_c=0.5"], r"algorithm.clip_c=0.5; allowed: None or a number > 1"),
        (["algorithm.tis_cap=2"], r"algorithm.tis_cap=2.0 needs algorithm.old_logp='recompute'"),
        (
            ["task.name=chess"],
            r"task.name='chess'; allowed: \[.*'arithmetic', 'arithmetic_lenient', .*'hotpotqa', .*'synthetic'.*\]",
        ),
        (["train=3"], r"train must be a mapping of fields"),
        (["steps"], r"must look like section.field=value"),
    ],
)
def test_bad_config_errors_name_the_field_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.samples'; did you mean 'rollout\.\w+'\?"):
        load_config(write(tmp_path, "rollout:\n  samples: 4\n"))


def test_reference_documents_every_field():
    from rolerl.config import AdapterConfig, RoleConfig

    ref = config_reference()
    sections = [(s.name, getattr(Config(), s.name)) for s in dataclasses.fields(Config)]
    sections = [(name, value) for name, value in sections if dataclasses.is_dataclass(value)]
    sections += [("roles.<name>", RoleConfig()), ("adapters.per_adapter.<name>", AdapterConfig())]
    for name, value in sections:
        assert f"### `{name}`" in ref
        for f in dataclasses.fields(value):
            line = next(x for x in ref.splitlines() if x.startswith(f"| `{f.name}` |"))
            assert line.rstrip(" |").split("|")[-1].strip(), f"{name}.{f.name} has no comment"
    assert "### `models`" in ref
    assert "(one of `grpo`, `dr_grpo`, `rloo`)" in ref


def test_training_docs_carry_the_current_reference():
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md"
    assert config_reference() in page.read_text(), (
        "regenerate docs/TRAINING.md's reference from config_reference()"
    )


def test_max_staleness_is_checked_with_what_asynchronous_training_needs():
    with pytest.raises(ConfigError, match=r"train.max_staleness=-1; allowed: null or an integer >= 0"):
        load_config(None, ["train.max_staleness=-1"])
    # stale rollouts need the decoupled loss: recomputed proximal log-probs and TIS weights
    with pytest.raises(ConfigError, match="algorithm.old_logp recompute or auto and algorithm.tis_cap"):
        load_config(None, ["train.max_staleness=1"])
    with pytest.raises(ConfigError, match="algorithm.old_logp recompute or auto and algorithm.tis_cap"):
        load_config(None, ["train.max_staleness=1", "algorithm.old_logp=recompute"])
    decoupled = ["algorithm.old_logp=auto", "algorithm.tis_cap=2.0"]
    for backend in ("lockstep", "threaded", "vllm", "auto"):  # every backend syncs to an adapter version
        load_config(None, ["train.max_staleness=2", f"rollout.backend={backend}", *decoupled])
    assert load_config(None, ["train.max_staleness=1", *decoupled]).train.async_lag == 1
    # two optimizer steps per training step: a bound of 1 allows no overlap, 2 one step, 5 two steps
    with pytest.raises(ConfigError, match=r"an adapter takes 2 optimizer steps .*train.max_staleness >= 2"):
        load_config(None, ["train.max_staleness=1", "train.mini_batches=2", *decoupled])
    lag = load_config(None, ["train.max_staleness=5", "train.mini_batches=2", *decoupled]).train.async_lag
    assert lag == 2
    merged = ["train.step_policy=merged", "train.mini_batches=2", "train.ppo_epochs=2"]  # one step per epoch
    assert load_config(None, ["train.max_staleness=2", *merged, *decoupled]).train.async_lag == 1
    # the batch decides the steps (mini-batches of 3 rows): the lag is the bound, tokens beyond it dropped
    assert (
        load_config(None, ["train.max_staleness=1", "train.mini_batch_size=3", *decoupled]).train.async_lag
        == 1
    )
    assert load_config(None, ["train.max_staleness=0"]).train.max_staleness == 0  # the synchronous loop
    assert Config().train.max_staleness is None  # off by default
