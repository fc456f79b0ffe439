"""Run configuration: nested dataclasses with defaults, `Literal` choices and validation, loaded from YAML
plus `--set section.field=value` overrides.

Every field has a default and a one-line comment; every section validates itself in `__post_init__` with
an error that names the field (`optim.lr`) and what is allowed (DESIGN style 8). Loading is strict: an
unknown key is an error that names the nearest valid key, a value of the wrong type is an error that
names the expected type, and a `Literal` field lists its choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from rolerl.errors import ConfigError

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@dataclass
class Section:
    """Base of every config section: checks `Literal` fields; subclasses add range checks."""

    _name = ""  # the section's key in `Config` (for error messages)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            hint = typing.get_type_hints(type(self))[f.name]
            choices = _literal_choices(hint)
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ConfigError(f"{self._name}.{f.name}={value!r}; allowed: {list(choices)}")
        self.check()

    def check(self) -> None:
        """Range checks; raise through `self.require`."""

    def require(self, ok: bool, name: str, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"{self._name}.{name}={getattr(self, name)!r}; allowed: {allowed}")


@dataclass
class ModelConfig(Section):
    _name = "model"
    spec: str = "default"  # 'default' (SmolLM2-135M-Instruct), 'tiny:<llama|qwen2|qwen3>', HF id, dir, .gguf
    # weights dtype, the rollout runs in it too (float32 keeps rollout and trainer log-probs equal); auto =
    # bfloat16 where the device has native bf16 (a GPU, or a CPU with AVX512-BF16/AMX), else float32
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available

    def check(self) -> None:
        self.require(bool(self.spec), "spec", "a non-empty model spec")


@dataclass
class AdapterConfig(Section):
    """One adapter's own settings (`adapters.per_adapter.<name>`); None = the `adapters`/`optim` value."""

    _name = "adapters.per_adapter.<name>"
    rank: int | None = None  # LoRA rank; None = adapters.rank
    alpha: float | None = None  # LoRA alpha; None = adapters.alpha (2 x rank when that is None)
    lr: float | None = None  # peak learning rate; None = optim.lr x the roles' lr_scale
    trainable: bool = True  # false: a frozen adapter (e.g. a warm-started tool agent held fixed)

    def check(self) -> None:
        self.require(self.rank is None or self.rank > 0, "rank", "null or an integer > 0")
        self.require(self.alpha is None or self.alpha > 0, "alpha", "null or a number > 0")
        self.require(self.lr is None or self.lr > 0, "lr", "null or a number > 0")


@dataclass
class AdaptersConfig(Section):
    _name = "adapters"
    # topology: which adapter each token trains; masked = shared, trained only on `train_kinds`; separate = an
    # adapter per role on that role's own model (`roles.<r>.model`, `models`); custom = `table`; none = base
    # only (evaluation: nothing to train)
    preset: Literal["shared", "dart", "isolated", "masked", "separate", "custom", "none"] = "shared"
    # preset custom: role -> adapter (every kind), or role -> {kind: adapter or null, default: adapter or null};
    # a kind not listed takes `default`, and a policy kind of a role must end up mapped (null = base only)
    table: dict[str, str | dict[str, str | None]] | None = None
    train_kinds: list[str] | None = None  # kinds that carry loss, e.g. [reasoning]; None = every policy kind
    # route: a token's loss reaches every adapter it depends on (through attention); strict: only the adapter
    # that computes its position (DART's gradient masking; one backward per adapter)
    isolation: Literal["route", "strict"] = "route"
    rank: int = 16  # LoRA rank of every adapter (per adapter: per_adapter.<name>.rank)
    alpha: float | None = None  # LoRA alpha; None = 2 * rank
    per_adapter: dict[str, AdapterConfig] = field(default_factory=dict)  # name -> rank, alpha, lr, trainable
    target_modules: str | list[str] = "all-linear"  # 'all-linear', a path regex, or names [q_proj, ...]
    init: str | None = None  # a directory with one PEFT adapter per name (e.g. `rolerl sft` output)
    # this run's adapter -> the adapter under `init` it starts from, where the names differ; "*" = every one
    # not listed. {"*": policy}: DART's reason and tool adapters both start from one shared warm start
    init_from: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        from rolerl.roles import POLICY_KINDS  # lazily: validating a config needs no torch until here

        allowed = sorted(POLICY_KINDS)
        self.require(_kinds_ok(self.train_kinds), "train_kinds", f"null or a non-empty list of {allowed}")
        if self.preset == "masked" and self.train_kinds is None:
            raise ConfigError(f"adapters.preset='masked' needs adapters.train_kinds: a list of {allowed}")
        if (self.preset == "custom") != (self.table is not None):
            raise ConfigError(
                f"adapters.table is {'set' if self.table is not None else 'missing'} with adapters.preset="
                f"{self.preset!r}: a table goes with preset custom, and preset custom needs a table "
                "(role -> adapter, or role -> {kind: adapter})"
            )
        self.require(self.rank > 0, "rank", "an integer > 0")
        self.require(self.alpha is None or self.alpha > 0, "alpha", "None or a number > 0")
        if self.init_from and not self.init:
            raise ConfigError(
                f"adapters.init_from={self.init_from} names adapters to start from, but adapters.init (the "
                "directory holding them) is not set"
            )


def _kinds_ok(kinds: list[str] | None) -> bool:
    from rolerl.roles import POLICY_KINDS

    return kinds is None or (bool(kinds) and set(kinds) <= POLICY_KINDS)


@dataclass
class TaskConfig(Section):
    _name = "task"
    # a built-in task (rolerl.tasks.TASKS), a benchmark (rolerl.tasks.BENCHMARKS; jsonl = your own JSONL
    # file, rewarded by exact match of the answer tag), or package.module:factory, your own: called with
    # task.data, it returns a Task (e.g. rolerl.tasks.JsonlTask(data, reward=your_function)); see the guide
    # docs/guides/own-workflow.md
    name: str = "arithmetic"
    # a benchmark's file, directory or dataset id (jsonl: your file); None = its default
    data: str | None = None
    workflow: str = "single_turn"  # a key of rolerl.workflows.WORKFLOWS, or package.module:Class (your own)
    workflow_options: dict[str, bool | int | float | str] = field(default_factory=dict)  # its settings
    split: str = "train"  # the split RL samples tasks from
    # RL draws only the problems of `split` at most this hard: GSM8K = the reference solution's steps (2-8+),
    # MATH = its level (1-5); a weak policy then sees more groups with both right and wrong samples (a signal).
    # Evaluation always reads the whole split. null = every problem
    max_difficulty: int | None = None

    def check(self) -> None:
        from rolerl.tasks import BENCHMARKS, TASKS
        from rolerl.workflows import WORKFLOWS

        self.require(
            self.name in TASKS or self.name in BENCHMARKS or ":" in self.name, "name",
            f"{sorted([*TASKS, *BENCHMARKS])} or package.module:factory",
        )  # fmt: skip
        self.require(
            self.max_difficulty is None or self.max_difficulty >= 1,
            "max_difficulty",
            "null or an integer >= 1",
        )
        self.require(
            self.name != "jsonl" or bool(self.data), "data", "the path of your JSONL file (task.name=jsonl)"
        )
        self.require(
            self.workflow in WORKFLOWS or ":" in self.workflow, "workflow",
            f"{sorted(WORKFLOWS)} or package.module:Class",
        )  # fmt: skip


VLLM_OPTIONS = (
    "gpu_memory_utilization", "max_loras", "max_lora_rank", "logprobs", "enforce_eager", "max_num_seqs",
    "url", "served_model", "dtype",
)  # fmt: skip


@dataclass
class RolloutConfig(Section):
    _name = "rollout"
    n: int = 8  # samples per task (the GRPO group size)
    max_new_tokens: int = 256  # sampled tokens per model call (tool output does not count)
    temperature: float = 1.0  # sampling temperature; the trainer's log-probs use the same one (DESIGN)
    top_p: float = 1.0  # nucleus sampling; 1 = off (the trainer's log-probs are untruncated either way)
    max_batch: int = 32  # rows the engine decodes at once
    max_len: int | None = None  # positions per call (prompt, samples, tool output); None = the model's max
    tool: Literal["none", "python", "search"] = (
        "none"  # the tool a closed tool tag calls (spliced as tool output)
    )
    # options of the tool's factory: python: SandboxConfig fields (timeout_s ...); search: corpus (a passage
    # file) or url (a Search-R1-style /retrieve server), k, timeout_s
    tool_options: dict[str, bool | int | float | str] = field(default_factory=dict)
    max_tool_calls: int = 4  # per model call
    # lockstep: the engine steps only when every episode waits on it (deterministic, exact resume);
    # threaded: EngineBackend's free-running engine thread (batch composition depends on timing);
    # vllm: vLLM's offline engine on the GPU, adapters synced after each step (docs/ROLLOUT.md);
    # auto = vllm where the model is on a GPU and vLLM is installed (or rollout.vllm.url is set), else lockstep
    # (on CPU the built-in engine measured faster than vLLM's CPU build: docs/ROLLOUT.md "vLLM")
    backend: Literal["lockstep", "threaded", "vllm", "auto"] = "lockstep"
    # the engine's weights: model = the trainer's own; bfloat16 = a bf16 copy of the model the engine
    # samples from (adapters copied after every step; needs algorithm.old_logp=recompute, tis_cap advised);
    # auto = bfloat16 where bf16 is native (a GPU, or a CPU with AVX512-BF16/AMX), else model
    dtype: Literal["model", "bfloat16", "float32", "auto"] = "model"
    # the engine's linear layers on CPU, on weights packed once (one more copy of the weights in memory unless
    # the engine has its own dtype copy): native = fp32 on the engine's own GEMM, a C kernel built with the
    # attention's; onednn = oneDNN's (fp32, or bf16 where native; 1.5-2x faster decode GEMMs at 8-64 rows than
    # F.linear); torch = F.linear; auto = native for fp32 where it builds, else onednn where supported.
    # docs/ROLLOUT.md, docs/BENCHMARKS.md
    kernels: Literal["auto", "native", "onednn", "torch"] = "auto"
    # the engine's decode attention on CPU: native = a C kernel built on first use with the machine's C
    # compiler (cc), reading the cache in place, in fp32; torch = SDPA (fp32: two matmuls); auto = native
    # where it builds with AVX2 or AVX-512, else torch. docs/ROLLOUT.md
    attention: Literal["auto", "native", "torch"] = "auto"
    # the routed adapters of the engine's decode steps on CPU (its own decoder, up to 128 tokens per forward):
    # native = each row through its own adapter's matrices in a C kernel built with the attention's; torch =
    # masked GEMMs over every adapter's ranks; auto = native where it builds. docs/ROLLOUT.md
    adapter_kernel: Literal["auto", "native", "torch"] = "auto"
    # with packed kernels, an LM head tied to the input embeddings (SmolLM2, Qwen2.5 up to 3B): share = run
    # on that matrix; copy = on a packed copy of it (the matrix held twice: +57 MB for the default model in
    # bf16, +545 MB for Qwen2.5-0.5B in fp32; a faster decode step on some CPUs). docs/ROLLOUT.md
    tied_head: Literal["share", "copy"] = "share"
    # the residual adds and RMSNorms of the engine's own decoder on CPU: native = one call of a C kernel built
    # with the attention's per norm, where torch runs eight small ops; torch = HF's modules; auto = native
    # where it builds. docs/ROLLOUT.md
    pointwise: Literal["auto", "native", "torch"] = "auto"
    # positions of finished calls' keys and values the built-in engine keeps, so that a call continuing one
    # (a multi-turn workflow's next turn) or starting as one did (a role's system prompt and problem) feeds
    # only what is new; 0 = none, the default (memory beside the KV cache; gsm8k-msarl sets 32768). Memory: up
    # to this many positions of the KV cache (the default model: 46 KB a position in fp32, so ~1.5 GB at
    # 32768); emptied as each rollout begins and whenever the weights change. docs/ROLLOUT.md
    prefix_cache: int = 0
    # rollout.backend=vllm: gpu_memory_utilization (0.5: the trainer shares the GPU), max_loras, max_lora_rank,
    # logprobs (processed | recompute), enforce_eager, max_num_seqs, dtype (auto | float32 | bfloat16 | float16;
    # auto = the model's, bfloat16 for an fp32 model on a GPU); url (a vLLM server instead of an engine in this
    # process) and served_model (its base model's name; default: the first it lists)
    vllm: dict[str, bool | int | float | str] = field(default_factory=dict)

    def check(self) -> None:
        self.require(self.n >= 1, "n", "an integer >= 1")
        self.require(self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1")
        self.require(self.temperature > 0, "temperature", "a number > 0 (RL samples; greedy is for eval)")
        self.require(0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        self.require(self.max_batch >= 1, "max_batch", "an integer >= 1")
        self.require(self.max_len is None or self.max_len >= 2, "max_len", "null or an integer >= 2")
        self.require(self.max_tool_calls >= 0, "max_tool_calls", "an integer >= 0")
        self.require(self.prefix_cache >= 0, "prefix_cache", "an integer >= 0 (positions; 0 = off)")
        unknown = sorted(set(self.vllm) - set(VLLM_OPTIONS))
        self.require(not unknown, "vllm", f"a mapping with keys among {list(VLLM_OPTIONS)} (got {unknown})")
        self.require(
            self.vllm.get("logprobs", "processed") in ("processed", "recompute"),
            "vllm", "logprobs 'processed' or 'recompute'",
        )  # fmt: skip
        self.require(
            self.vllm.get("dtype", "auto") in ("auto", "float32", "bfloat16", "float16"),
            "vllm", "dtype 'auto', 'float32', 'bfloat16' or 'float16'",
        )  # fmt: skip


@dataclass
class AlgorithmConfig(Section):
    _name = "algorithm"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"  # rolerl.algorithms.ADVANTAGES
    # Advantage group of one model call: `task` = all calls of a task's n episodes; `role` = (task, role);
    # `role_instance` = (task, role, k-th call of that role in its episode), verl's per-step grouping.
    group_key: Literal["task", "role", "role_instance"] = "task"
    loss_agg: LossAgg = "token-mean"  # verl's loss_agg_mode (rolerl.algorithms.AGGREGATIONS)
    clip_low: float = 0.2  # PPO ratio clip below 1
    clip_high: float = 0.28  # PPO ratio clip above 1 (DAPO clip-higher 0.28)
    clip_c: float | None = None  # dual clip for A < 0 (> 1), None = off
    kl: Literal["k1", "k3"] = "k3"  # KL estimator to the reference (adapters off)
    beta: float = 0.0  # KL weight; 0 = no reference forward at all
    entropy_coef: float = 0.0  # entropy bonus weight
    # PPO's old log-probs: the engine's, or recomputed by the trainer; auto = recompute where the rollout
    # computes otherwise than the trainer (a bf16 rollout copy, bf16 autocast in training, vLLM), else the
    # engine's (the trainer's weights, the same arithmetic: equal up to kernel rounding, one forward saved)
    old_logp: Literal["rollout", "recompute", "auto"] = "rollout"
    # truncated importance sampling cap (needs old_logp=recompute, or auto where that resolves to recompute);
    # None = off
    tis_cap: float | None = None
    filter_zero_variance: bool = False  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    # A call's reward: outcome = the episode's; role = the call's own (`Turn.reward`), else its role's
    # (`Episode.role_rewards`), else the outcome; mix = mix_alpha x outcome + the call's or role's own (0 if none)
    reward: Literal["outcome", "role", "mix"] = "role"
    mix_alpha: float = 1.0  # the team (outcome) term's weight under reward=mix
    # GRPO's std: group = of the advantage group's rewards; role = of each role's group-centred rewards
    # over the whole step (Dr. MAS's per-agent normalisation: every role's advantages get unit scale)
    norm: Literal["group", "role"] = "group"
    # Each role's share of the loss: aggregate = whatever loss_agg gives (seq-mean modes: its share of the
    # outputs, token-mean: of the tokens); outputs / tokens = that share whatever the aggregation; equal =
    # 1/R each; or {role: weight} (normalised to sum 1). roles.<r>.loss_weight multiplies on top.
    role_share: Literal["aggregate", "outputs", "tokens", "equal"] | dict[str, float] = "aggregate"

    def check(self) -> None:
        if isinstance(self.role_share, dict):
            self.require(
                bool(self.role_share) and all(w >= 0 for w in self.role_share.values())
                and sum(self.role_share.values()) > 0, "role_share",
                "aggregate, outputs, tokens, equal, or {role: weight >= 0} with a positive sum",
            )  # fmt: skip
        else:
            self.require(
                self.role_share in ("aggregate", "outputs", "tokens", "equal"), "role_share",
                "aggregate, outputs, tokens, equal, or {role: weight}",
            )  # fmt: skip
        self.require(self.mix_alpha >= 0, "mix_alpha", "a number >= 0")
        if self.norm == "role" and self.advantage != "grpo":
            raise ConfigError(
                f"algorithm.norm='role' sets GRPO's std per role, but algorithm.advantage={self.advantage!r} "
                "divides by no std; use advantage=grpo or norm=group"
            )
        self.require(0 <= self.clip_low < 1, "clip_low", "a number in [0, 1)")
        self.require(self.clip_high >= 0, "clip_high", "a number >= 0")
        self.require(self.clip_c is None or self.clip_c > 1, "clip_c", "None or a number > 1")
        self.require(self.beta >= 0, "beta", "a number >= 0")
        self.require(self.tis_cap is None or self.tis_cap > 0, "tis_cap", "None or a number > 0")
        if self.tis_cap is not None and self.old_logp == "rollout":
            raise ConfigError(
                f"algorithm.tis_cap={self.tis_cap} needs algorithm.old_logp='recompute' or 'auto' (TIS reweights "
                f"rollout samples by trainer/rollout probability); got old_logp={self.old_logp!r}"
            )


@dataclass
class OptimConfig(Section):
    _name = "optim"
    lr: float = 2e-5  # AdamW peak learning rate (PAPERS 1.5: the paper-3 runs use 2e-5 with LoRA)
    warmup_steps: int = 0  # linear warm-up, in training steps
    schedule: Literal["cosine", "constant"] = "cosine"  # after warm-up
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max grad norm; 0 = off
    clip_scope: Literal["global", "group"] = "global"  # grad_clip over all adapters at once, or each alone
    weight_decay: float = 0.01  # AdamW decoupled weight decay (verl default)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas

    def check(self) -> None:
        self.require(self.lr > 0, "lr", "a number > 0")
        self.require(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0")
        self.require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a number in [0, 1]")
        self.require(self.grad_clip >= 0, "grad_clip", "a number >= 0 (0 = off)")
        self.require(self.weight_decay >= 0, "weight_decay", "a number >= 0")
        self.require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "[b1, b2] in [0, 1)"
        )


@dataclass
class TrainConfig(Section):
    _name = "train"
    steps: int = 100  # training steps (one rollout batch each)
    tasks_per_step: int = 4  # tasks per step; each is rolled out rollout.n times
    mini_batches: int = 1  # optimizer steps per PPO epoch (the batch is split into this many)
    mini_batch_size: int | None = (
        None  # rows per mini-batch instead (the last may be smaller); None = mini_batches
    )
    # batch: mini-batches mix every role's rows; role: each role's rows are cut into their own mini-batches
    # (verl's update per role: a role with k times the calls fills k times the mini-batches)
    mini_batch_by: Literal["batch", "role"] = "batch"
    ppo_epochs: int = 1  # passes over each step's batch
    # sequences per forward/backward; gradients accumulate (exactly). With share_prefix, a call that a later
    # call of its conversation continues runs inside that one and is not counted
    micro_batch_size: int = 8
    # bf16 autocast for the training forward; auto = on where bf16 is native (GPU, or a CPU with AVX512-BF16
    # or AMX; rolerl.hardware), off elsewhere (emulated bf16 is ~45x slower than fp32 on an AVX2 CPU)
    bf16: bool | Literal["auto"] = "auto"
    # positions per chunk in the log-prob computation; auto = on CPU the most whose fp32 logits fit in 32 MB
    # (the largest block the kept heap serves: 170 at a 49,152-token vocabulary), 512 on GPUs
    logprob_chunk: int | Literal["auto"] = "auto"
    # compute a prompt shared by several rows (a GRPO group), or a start rows' prompts share (a system
    # prompt, a problem), once per micro-batch (RL and imitation), and a row that another row starts with (a
    # conversation's call, which its next call continues) inside that row; RL keeps those rows together
    share_prefix: bool = True
    # rows whose loss is zero at every token (zero advantage, e.g. a GRPO group whose samples all scored alike,
    # and no KL or entropy term for their role) run no forward or backward in the update: the same gradient
    # (they add exact zeros). The entropy, PPO ratio and rollout/trainer mismatch metrics then cover the rows
    # that ran (none in a step where every group scored alike); `update/inert_frac` logs the share skipped
    skip_inert_rows: bool = True
    # per_minibatch: each mini-batch is one optimizer step of every adapter it touched (an adapter whose role
    # fills k mini-batches takes k steps); merged: each adapter takes one step per PPO epoch, its gradient
    # accumulated over every mini-batch (each mini-batch normalised on its own, as per_minibatch)
    step_policy: Literal["per_minibatch", "merged"] = "per_minibatch"
    # keep: the process keeps the memory it frees (glibc: the heap is never trimmed, blocks up to 32 MB come
    # from it), so the next micro-batch and step reuse those pages instead of faulting them in again (~12 s
    # of a 512-token GRPO update on 2 cores); its resident size stays near its peak between steps
    # (rolerl.heap). trim: glibc's defaults, and the engine trims the heap when it sizes a rollout's KV cache
    heap: Literal["keep", "trim"] = "keep"
    # the trainer's products with frozen fp32 weights on CPU: the base layers' input gradient `dy W` and the LM
    # head's; onednn = oneDNN's matmul (torch's MKL ran at its AVX2 speed on an AMD CPU with AVX-512, where
    # oneDNN's was ~2x faster: an fp32 GRPO update 1.36x), torch = torch's own ops (MKL), auto = onednn on
    # AMD CPUs, torch elsewhere (on an Intel Xeon, MKL was as fast or faster). bf16 autocast and GPUs use
    # torch's ops either way. docs/BENCHMARKS.md ("fp32 training GEMMs")
    kernels: Literal["auto", "onednn", "torch"] = "auto"
    # under torchrun: how long a collective waits for a rank that neither answers nor dies (one that dies
    # stops the job at once: torchrun ends the others); above the slowest rank's lead at a gather (a long
    # rollout, rank 0 writing a checkpoint). docs/DISTRIBUTED.md ("When a rank fails")
    dist_timeout_s: float = 1800.0
    # asynchronous training: null = the synchronous loop; k >= 0 = tokens may be up to k optimizer steps of
    # their own adapter behind: the rollout of step s samples from the adapters after step s - 1 - k / m (m =
    # ppo_epochs x mini_batches, 1 where the batch decides), generated while earlier steps train (0 = the
    # synchronous loop, bit for bit); a call with a token beyond k is dropped from the update. k >= 1 needs
    # algorithm.old_logp recompute or auto and a tis_cap (decoupled PPO: docs/TRAINING.md)
    max_staleness: int | None = None
    # with max_staleness >= 1: a rollout in flight switches, between two decode steps, to each newer version
    # of the adapters the trainer publishes (never one after step s - 1 for step s's rollout) and recomputes
    # its rows' KV cache under it, so a call's tokens may carry several versions, each token's log-prob its
    # own version's; the switch moment depends on timing, so such a run is not bit-reproducible (false: each
    # rollout samples one version, reproducibly). Built-in engine only (rollout.backend lockstep or threaded)
    partial_rollouts: bool = False

    @property
    def adapter_steps_per_step(self) -> int | None:
        """The optimizer steps an adapter takes per training step, where the config fixes it (the batch cut
        into `mini_batches` alike for every role); None where it depends on the batch (`mini_batch_size`,
        `mini_batch_by: role`)."""
        if self.mini_batch_size is not None or self.mini_batch_by == "role":
            return None
        return self.ppo_epochs * (1 if self.step_policy == "merged" else self.mini_batches)

    @property
    def async_lag(self) -> int:
        """How many training steps behind the rollouts sample under `max_staleness` (0: synchronous): as
        many as keep every token within the bound where `adapter_steps_per_step` is known."""
        return (self.max_staleness or 0) // (self.adapter_steps_per_step or 1)

    @property
    def chunk_size(self) -> int | None:
        """`logprob_chunk` as the trainer takes it: None for auto (`chunk_positions`)."""
        return None if self.logprob_chunk == "auto" else self.logprob_chunk

    def check(self) -> None:
        self.require(self.bf16 in (True, False, "auto"), "bf16", "true, false or auto")
        for name in (
            "steps",
            "tasks_per_step",
            "mini_batches",
            "ppo_epochs",
            "micro_batch_size",
        ):
            self.require(getattr(self, name) >= 1, name, "an integer >= 1")
        chunk = self.logprob_chunk
        self.require(
            chunk == "auto" or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1),
            "logprob_chunk",
            "auto or an integer >= 1",
        )
        self.require(
            self.mini_batch_size is None or self.mini_batch_size >= 1, "mini_batch_size", "null or >= 1"
        )
        self.require(self.dist_timeout_s > 0, "dist_timeout_s", "a number of seconds > 0")
        self.require(
            self.max_staleness is None or self.max_staleness >= 0, "max_staleness", "null or an integer >= 0"
        )


@dataclass
class RunConfig(Section):
    _name = "run"
    dir: str = "runs/run"  # the run directory (config, metrics, TensorBoard, checkpoints)
    seed: int = 0  # seeds tasks, sampling and shuffling
    checkpoint_every: int = 10  # steps between checkpoints (the last step is always saved)
    keep_last: int = 3  # checkpoints kept (older ones deleted)
    tensorboard: bool = True  # write TensorBoard logs when `tensorboard` is installed
    progress: bool = True  # progress bars (rolerl's; transformers' and the hub's as a model loads); rank 0
    # a W&B project: log metrics, the config and the run's PNGs there (pip install 'rolerl[wandb]';
    # WANDB_MODE=offline works without a server); null = no W&B
    wandb: str | None = None
    wandb_entity: str | None = None  # the W&B user or team that owns run.wandb; null = your default entity

    def check(self) -> None:
        self.require(self.checkpoint_every >= 1, "checkpoint_every", "an integer >= 1")
        self.require(self.keep_last >= 1, "keep_last", "an integer >= 1")
        # W&B refuses these characters in a project name, and only says so once the run starts
        self.require(
            self.wandb is None or (0 < len(self.wandb) <= 128 and not set(self.wandb) & set("/\\#?%:")),
            "wandb",
            "null or a W&B project name (1-128 characters, none of / \\ # ? % :)",
        )
        self.require(self.wandb_entity is None or bool(self.wandb_entity), "wandb_entity", "null or a name")


@dataclass
class SFTConfig(Section):
    _name = "sft"
    # JSONL of demonstrations: {"role": ..., "messages": [chat messages], "id": optional} per line; rows of
    # one id train in one step
    data: str = ""
    epochs: int = 1  # passes over the data
    # rows per optimizer step (whole demonstrations, at most this many rows unless one is larger)
    batch_size: int = 8
    max_len: int = 2048  # longer demonstrations are cut (and warned about)
    lr: float = 1e-4  # AdamW learning rate for imitation (the rest of `optim` applies)

    def check(self) -> None:
        self.require(self.epochs >= 1, "epochs", "an integer >= 1")
        self.require(self.batch_size >= 1, "batch_size", "an integer >= 1")
        self.require(self.max_len >= 2, "max_len", "an integer >= 2")
        self.require(self.lr > 0, "lr", "a number > 0")


ROLE_TAGS = ("tool_open", "tool_close", "output_open", "output_close")  # `roles.<r>.tags` keys


@dataclass
class RoleConfig(Section):
    """`roles.<role>`: one role's model, credit, loss and call settings (the rest come from the sections)."""

    _name = "roles.<role>"
    model: str = "main"  # the model its calls run on: main (model.spec) or a key of `models`
    lr_scale: float = 1.0  # multiplies optim.lr for the adapters this role trains (they must agree if shared)
    loss_weight: float = 1.0  # multiplies this role's loss, on top of algorithm.role_share
    beta: float | None = None  # KL weight on this role's tokens; None = algorithm.beta
    entropy_coef: float | None = None  # entropy bonus on this role's tokens; None = algorithm.entropy_coef
    train_kinds: list[str] | None = None  # kinds that carry this role's loss; None = adapters.train_kinds
    # call settings that leave the trainer's log-probs as they are (not the temperature); None = rollout.*
    max_new_tokens: int | None = None  # sampled tokens per call of this role
    top_p: float | None = None  # nucleus sampling for this role's calls
    max_tool_calls: int | None = None  # tool calls per call of this role
    tool: Literal["none", "python", "search"] | None = (
        None  # the tool its calls may call; null = rollout.tool
    )
    stop: list[str] | None = None  # stop strings added to the workflow's own for this role's calls
    # the tool-call and tool-output tags of this role's calls, replacing the workflow's, e.g. {tool_open:
    # <tool_call>, tool_close: </tool_call>}; keys tool_open, tool_close, output_open, output_close (answer
    # tags belong to the task's grader)
    tags: dict[str, str] | None = None

    def check(self) -> None:
        from rolerl.roles import POLICY_KINDS

        self.require(bool(self.model), "model", "main or a key of models")
        self.require(self.lr_scale > 0, "lr_scale", "a number > 0")
        self.require(self.loss_weight >= 0, "loss_weight", "a number >= 0")
        self.require(self.beta is None or self.beta >= 0, "beta", "null or a number >= 0")
        self.require(
            self.entropy_coef is None or self.entropy_coef >= 0, "entropy_coef", "null or a number >= 0"
        )
        self.require(
            _kinds_ok(self.train_kinds), "train_kinds", f"null or a non-empty list of {sorted(POLICY_KINDS)}"
        )
        self.require(
            self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens", "null or >= 1"
        )
        self.require(self.top_p is None or 0 < self.top_p <= 1, "top_p", "null or a number in (0, 1]")
        self.require(
            self.max_tool_calls is None or self.max_tool_calls >= 0, "max_tool_calls", "null or >= 0"
        )
        self.require(self.tool in (None, "none", "python", "search"), "tool", "null, none, python or search")
        self.require(
            self.tags is None
            or (
                set(self.tags) <= set(ROLE_TAGS) and all(isinstance(v, str) and v for v in self.tags.values())
            ),
            "tags",
            f"null or a mapping of {list(ROLE_TAGS)} to non-empty strings",
        )
        self.require(
            self.stop is None or all(isinstance(x, str) and x for x in self.stop),
            "stop",
            "null or a list of non-empty strings",
        )


@dataclass
class EvalConfig(Section):
    _name = "eval"
    every: int = 0  # evaluate on held-out examples every this many steps (and after the last); 0 = off
    task: str | None = None  # a task or benchmark name; None = task.name
    data: str | None = None  # the benchmark's file or dataset id (None = the task's default)
    split: str = "test"  # held out from training's task.split
    limit: int = 64  # examples (the same ones every time)
    n: int = 1  # samples per example (pass@k for k up to n)
    temperature: float = 0.0  # 0 = greedy (then n must be 1)
    max_new_tokens: int | None = None  # None = rollout.max_new_tokens

    def check(self) -> None:
        self.require(self.every >= 0, "every", "an integer >= 0 (0 = off)")
        self.require(self.limit >= 1, "limit", "an integer >= 1")
        self.require(self.n >= 1, "n", "an integer >= 1")
        self.require(self.temperature >= 0, "temperature", "0 (greedy) or a number > 0")
        if self.temperature == 0 and self.n > 1:
            raise ConfigError(
                f"eval.n={self.n} needs sampling: set eval.temperature > 0 (greedy repeats one answer)"
            )


@dataclass
class DiagnosticsConfig(Section):
    _name = "diagnostics"
    # every this many steps: each role's gradient norm on each adapter and the cosine between roles'
    # gradients on a shared adapter (one extra backward per role); 0 = off
    grad_every: int = 0
    # what the gradients are split by: role (each role's calls) or kind (each policy kind's tokens:
    # reasoning, tool call, answer); pairs also log the share of the adapter's modules in conflict
    grad_groups: Literal["role", "kind"] = "role"

    def check(self) -> None:
        self.require(self.grad_every >= 0, "grad_every", "an integer >= 0 (0 = off)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    # more base models by name (the main one is model.spec): {coder: tiny:qwen3}; roles.<r>.model picks one
    models: dict[str, str] = field(default_factory=dict)
    roles: dict[str, RoleConfig] = field(default_factory=dict)  # per-role settings, by role name

    def __post_init__(self) -> None:
        for role, rc in self.roles.items():
            if rc.model != "main" and rc.model not in self.models:
                raise ConfigError(
                    f"roles.{role}.model={rc.model!r}; allowed: main or a key of models {sorted(self.models)}"
                )
        if "main" in self.models:
            raise ConfigError("models.main: the main model is model.spec; give the others other names")
        self._check_async()

    def _check_async(self) -> None:
        """Stale rollouts need the decoupled loss: behaviour log-probs (the rollout's), a proximal policy
        recomputed by the trainer, and TIS weights between the two."""
        k = self.train.max_staleness
        if self.train.partial_rollouts and not k:
            raise ConfigError(
                f"train.partial_rollouts=true continues rollouts across the asynchronous loop's syncs: it needs "
                f"train.max_staleness >= 1; got max_staleness={k!r}"
            )
        if self.train.partial_rollouts and self.rollout.backend not in ("lockstep", "threaded"):
            raise ConfigError(
                "train.partial_rollouts=true switches the built-in engine's adapters mid-rollout: it needs "
                f"rollout.backend lockstep or threaded; got rollout.backend={self.rollout.backend!r}"
            )
        if not k:
            return
        alg = self.algorithm
        if alg.old_logp == "rollout" or alg.tis_cap is None:
            raise ConfigError(
                f"train.max_staleness={k} samples from adapters up to {k} steps old: the update needs "
                "algorithm.old_logp recompute or auto and algorithm.tis_cap (e.g. 2.0) to correct for it; got "
                f"old_logp={alg.old_logp!r}, tis_cap={alg.tis_cap!r}"
            )
        per = self.train.adapter_steps_per_step
        if per is not None and k < per:
            raise ConfigError(
                f"train.max_staleness={k}: an adapter takes {per} optimizer steps per training step "
                f"(train.ppo_epochs x train.mini_batches), so a rollout one step behind is {per} of its steps "
                f"behind: give train.max_staleness >= {per} (each {per} allow one step of overlap)"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> dataclasses, strictly


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read `path` (YAML, or the name of an example shipped with rolerl: `voting`; None = defaults), apply
    `section.field=value` overrides, validate."""
    from rolerl import configs

    data: dict[str, Any] = {}
    if path is not None:
        loaded = _read_yaml(configs.resolve(path))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{str(path)!r} must hold a mapping of sections; got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        apply_override(data, item)
    return from_dict(Config, data)


def _read_yaml(path: Path) -> Any:
    """The YAML document at `path`; a missing file, a directory or malformed YAML is a one-line error."""
    from rolerl import configs

    if path.is_dir():
        raise ConfigError(
            f"config {str(path)!r} is a directory; give a YAML file or an example's name (e.g. smoke)"
        )
    if not path.is_file():
        if configs.path_of(path.name):
            raise ConfigError(
                f"config file {str(path)!r} does not exist; rolerl ships it as an example: give its name, "
                f"{path.stem!r} (`rolerl configs list` shows them all)"
            )
        raise ConfigError(
            f"config file {str(path)!r} does not exist; give a YAML file or the name of an example shipped "
            f"with rolerl ({', '.join(configs.names())})"
        )
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected YAML)") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """`problem at line L, column C` from a YAML error (its own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def apply_override(data: dict[str, Any], item: str) -> None:
    """`"a.b=value"` into nested `data`; the value is parsed as YAML (`1e-4`, `true`, `[q_proj]`, `null`)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {item!r}: the value {raw!r} is not valid YAML ({_yaml_problem(e)}); quote strings "
            "and close brackets, e.g. optim.betas=[0.9,0.95]"
        ) from None


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping: unknown keys and wrong types are `ConfigError`s."""
    where = path or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of fields; got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.0)
            hint = f"; did you mean {(f'{path}.' if path else '') + near[0]!r}?" if near else ""
            raise ConfigError(f"unknown key {full!r}{hint} (valid keys of {where}: {names})")
        kwargs[key] = _coerce(hints[key], value, full)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section under a mapping (roles.coder): name it by its path
        generic = getattr(cls, "_name", "")
        if path and generic and str(e).startswith(f"{generic}."):
            raise ConfigError(f"{path}{str(e)[len(generic) :]}") from None
        raise


def _literal_choices(hint: Any) -> tuple | None:
    if get_origin(hint) is Literal:
        return get_args(hint)
    return None


def _type_name(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return f"one of {list(get_args(hint))}"
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(hint))
    if get_origin(hint) is list:
        return f"a list of {_type_name(get_args(hint)[0])}"
    if get_origin(hint) is dict:
        return f"a mapping of names to {_type_name(get_args(hint)[1])}"
    return {
        type(None): "null",
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }.get(hint, getattr(hint, "__name__", str(hint)))


def _coerce(hint: Any, value: Any, name: str) -> Any:
    """`value` as type `hint`, or a `ConfigError` naming `name` and the expected type."""
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name)
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in [a for a in args if a is not type(None) and get_origin(a) is not Literal]:
            try:
                return _coerce(arg, value, name)
            except ConfigError:
                continue
        if any(get_origin(a) is Literal for a in args):
            return value  # the section's check names the field, the choices and the other forms
        raise ConfigError(f"{name}={value!r}; expected {_type_name(hint)}")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{name}={value!r}; allowed: {list(get_args(hint))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r}; expected {_type_name(hint)}")
        key_type, value_type = get_args(hint)
        return {
            _coerce(key_type, k, f"{name} key"): _coerce(value_type, v, f"{name}.{k}")
            for k, v in value.items()
        }
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}={value!r}; expected {_type_name(hint)}")
        return [_coerce(get_args(hint)[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{name}={value!r}; expected {_type_name(hint)}")


def config_reference() -> str:
    """Markdown tables of every section's fields, defaults and comments (docs/TRAINING.md is built from it)."""
    import inspect

    lines: list[str] = []
    top = inspect.getsource(Config)
    for f in dataclasses.fields(Config):
        hint = typing.get_type_hints(Config)[f.name]
        if dataclasses.is_dataclass(hint):
            lines += _section_table(f"`{f.name}`", hint)
        elif get_origin(hint) is dict and dataclasses.is_dataclass(get_args(hint)[1]):
            lines += _section_table(
                f"`{f.name}.<name>`: {_field_comments(top).get(f.name, '')}", get_args(hint)[1]
            )
        else:
            lines += [
                f"### `{f.name}`",
                "",
                f"{_field_comments(top).get(f.name, '')} Default `{f.default_factory()!r}`.",
                "",
            ]  # type: ignore[misc]
    return "\n".join(lines)


def _section_table(title: str, cls: type) -> list[str]:
    """One section's table, then a table for each mapping of sub-sections in it (adapters.per_adapter)."""
    import inspect

    comments = _field_comments(inspect.getsource(cls))
    lines = [f"### {title}", "", "| field | default | meaning |", "|---|---|---|"]
    default, nested = cls(), []
    for sf in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[sf.name]
        value = getattr(default, sf.name)
        choices = _literal_choices(hint)
        meaning = comments.get(sf.name, "")
        if choices:
            meaning += f" (one of {', '.join(f'`{c}`' for c in choices)})"
        lines.append(f"| `{sf.name}` | `{value!r}` | {meaning.replace('|', '/')} |")
        if get_origin(hint) is dict and dataclasses.is_dataclass(get_args(hint)[1]):
            nested.append((sf.name, get_args(hint)[1]))
    lines.append("")
    name = title.split("`")[1]
    for field_name, sub in nested:
        lines += _section_table(f"`{name}.{field_name}.<name>`", sub)
    return lines


def _field_comments(source: str) -> dict[str, str]:
    """`name -> comment` from `name: type = default  # comment` lines (and a comment block just above)."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        if ":" in stripped and not stripped.startswith(("def ", "class ", "_name", '"')):
            name = stripped.split(":", 1)[0].strip()
            if name.isidentifier():
                comment = line.split("  # ", 1)[1].strip() if "  # " in line else ""
                out[name] = " ".join([*above, comment]).strip()
        above = []
    return out
