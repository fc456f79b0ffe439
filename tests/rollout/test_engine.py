"""The rollout engine against HF `generate`, a teacher-forced routed forward, and itself (batch invariance)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from peft import LoraConfig, get_peft_model

import rolerl
from rolerl.roles import shift, token_bytes
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams, counter_uniform
from rolerl.tools.base import ToolResult
from tests.models.test_lora import copy_into_peft, randomize_adapters
from tests.tolerance import ulp_tol

ALL_KINDS = ("prompt", "reasoning", "tool_call", "tool_output", "answer")


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=2,
    )
    return out[0, len(ids) :].tolist()


PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time there was a"]


def test_greedy_equals_hf_generate_without_adapters(tiny):
    model, tok = tiny
    engine = Engine(model, tok, max_batch=4)
    reqs = [
        GenerationRequest(prompt_ids(tok, p), SamplingParams(greedy=True, max_new_tokens=12)) for p in PROMPTS
    ]
    turns = engine.generate(reqs)
    for req, turn in zip(reqs, turns, strict=True):
        assert turn.completion_ids == hf_greedy(model, req.prompt_ids, 12)
        assert turn.finish_reason in ("length", "eos")


def test_greedy_equals_peft_generate_with_an_adapter_on_every_token(tiny):
    model, tok = tiny
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    rolerl.add_adapters(model, "policy", rank=4, alpha=8)
    randomize_adapters(model, std=0.2)
    copy_into_peft(model, peft_model, "policy")
    route_of = dict.fromkeys(ALL_KINDS, 0)
    reqs = [
        GenerationRequest(
            prompt_ids(tok, p), SamplingParams(greedy=True, max_new_tokens=12), route_of=route_of
        )
        for p in PROMPTS
    ]
    turns = Engine(model, tok, max_batch=3).generate(reqs)
    base_outputs = [hf_greedy(model, r.prompt_ids, 12) for r in reqs]  # no routes block: base model
    assert any(t.completion_ids != b for t, b in zip(turns, base_outputs, strict=True)), "adapter must matter"
    for req, turn in zip(reqs, turns, strict=True):
        assert turn.completion_ids == hf_greedy(peft_model, req.prompt_ids, 12)
        assert set(turn.routes) == {0}


def test_ids_past_the_tokenizer_in_a_padded_vocabulary():
    """Qwen3's head has 151,936 rows for 151,669 tokens: a sampled id with no token must not break the
    row's byte bookkeeping (it decodes to nothing, as `tokenizer.decode` skips it). Here the tiny model's
    head has 512 rows for the byte tokenizer's 259 tokens, and greedy decoding lands past 259."""
    from transformers import AutoModelForCausalLM

    from rolerl.models.tiny import byte_tokenizer, tiny_config

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab_size=512)).eval()
    with torch.no_grad():  # large padded rows: greedy picks ids that have no token
        model.get_output_embeddings().weight[len(tok) :] *= 20
    engine = Engine(model, tok, max_batch=2)
    (turn,) = engine.generate([GenerationRequest(prompt_ids(tok, "hi"), SamplingParams(greedy=True, max_new_tokens=8,
                                                                                         ignore_eos=True))])  # fmt: skip
    assert any(i >= len(tok) for i in turn.completion_ids) and len(turn.completion_ids) == 8
    assert turn.completion_ids == hf_greedy(model, prompt_ids(tok, "hi"), 8)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [False, True])
def test_greedy_equals_hf_on_default_model(default_model_cpu, adapter):
    base, tok = default_model_cpu
    model, hf_model, route_of = base, base, None
    if adapter:  # a non-zero adapter on every token, against PEFT with the same weights
        model = copy.deepcopy(base)
        rolerl.add_adapters(model, "policy", rank=8, alpha=16)
        randomize_adapters(model, std=0.02)
        hf_model = get_peft_model(
            copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        )
        copy_into_peft(model, hf_model, "policy")
        route_of = dict.fromkeys(ALL_KINDS, 0)
    chats = [
        [{"role": "user", "content": q}] for q in ["What is 2+3?", "Name a colour.", "Say hello in French."]
    ]
    ids = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for c in chats
    ]
    reqs = [
        GenerationRequest(list(i), SamplingParams(greedy=True, max_new_tokens=16), route_of=route_of)
        for i in ids
    ]
    turns = Engine(model, tok, max_batch=2).generate(reqs)  # 3 requests through 2 slots
    for req, turn in zip(reqs, turns, strict=True):
        assert turn.completion_ids == hf_greedy(hf_model, req.prompt_ids, 16)


# ---- scripted episodes: exact tokens through the real engine ---------------------------------------------


def scripted_sampler(scripts: dict[int, list[int]]):
    """Pick the script's next token for each row (the row's seed names its script) and record its real
    log-prob under the engine's logits, so kinds, routes, splicing and log-probs are all exercised."""

    def sampler(logits, params, seeds, counters):
        tokens = torch.tensor([scripts[int(s)][int(c)] for s, c in zip(seeds, counters, strict=True)])
        scale = torch.tensor([p.scale for p in params])[:, None]
        logp = torch.log_softmax(logits.float() / scale, -1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logp

    return sampler


def scripted_requests(tok, steps: int, seed: int = 0) -> tuple[dict[int, list[int]], list[GenerationRequest]]:
    """Random scripts of `steps` token ids, one per prompt of PROMPTS (for `scripted_sampler`), and the
    requests that play them: a row's seed names its script."""
    g = torch.Generator().manual_seed(seed)
    scripts = {s: torch.randint(0, 1000, (steps,), generator=g).tolist() for s in range(len(PROMPTS))}
    reqs = [
        GenerationRequest(prompt_ids(tok, p), SamplingParams(seed=s, max_new_tokens=steps, ignore_eos=True))
        for s, p in enumerate(PROMPTS)
    ]
    return scripts, reqs


class EchoTool:
    """A scripted tool: prints the call's code back `repeat` times, so outputs differ in length per row."""

    name, description = "echo", "repeats its input"

    def run(self, args: str) -> ToolResult:
        repeat = 1 + len(args) % 4
        return ToolResult(stdout=(args.strip() + " ") * repeat + "\n", wall_s=0.0)


SCRIPTS = [
    "I will compute it.<code>print(1 + 2)</code>The result is 3.",
    "Let me check<code>x = 7\nprint(x * 6)</code>. So 42, and again:<code>print(42)</code>Done",
    "No tool here, just text.",
]


def expected_kinds(tok, ids: list[int]) -> list[str]:
    """Independent derivation from byte offsets: a token is tool_call iff its left edge lies in
    [end of "<code>", end of the next "</code>") of the sampled text."""
    table = token_bytes(tok)
    text = b"".join(table[i] for i in ids)
    spans, start = [], 0
    while (o := text.find(b"<code>", start)) >= 0:
        c = text.find(b"</code>", o)
        spans.append((o + len(b"<code>"), c + len(b"</code>")))
        start = c + 1
    kinds, edge = [], 0
    for i in ids:
        kinds.append("tool_call" if any(a <= edge < b for a, b in spans) else "reasoning")
        edge += len(table[i])
    return kinds


def teacher_forced_logprobs(model, ids: list[int], routes: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids]), routes=torch.tensor([routes])).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]


def scripted_episodes(model, tok, route_of, engine_model=None, source=None):
    """An engine whose sampler replays SCRIPTS (one per seed, tool calls included) and one echo-tool request
    per script; `engine_model` (default `model`) is what the engine samples from, `source` its weights'."""
    scripts = {seed: prompt_ids(tok, text) for seed, text in enumerate(SCRIPTS)}
    engine = Engine(
        engine_model if engine_model is not None else model, tok, max_batch=3, tools={"echo": EchoTool()},
        sampler=scripted_sampler(scripts), source=source,
    )  # fmt: skip
    reqs = [
        GenerationRequest(
            prompt_ids(tok, "Question: what is it?\n"),
            SamplingParams(temperature=0.7, seed=seed, max_new_tokens=len(s)),
            route_of=route_of,
            tool="echo",
        )
        for seed, s in scripts.items()
    ]
    return engine, reqs


def test_scripted_tool_episodes_kinds_routes_and_logprobs(tiny):
    model, tok = tiny
    rolerl.add_adapters(model, ["reason", "tool", "output"], rank=4)
    randomize_adapters(model, std=0.2)
    route_of = {"prompt": 0, "reasoning": 0, "tool_call": 1, "tool_output": 2, "answer": 0}
    engine, reqs = scripted_episodes(model, tok, route_of)
    scripts = {seed: prompt_ids(tok, text) for seed, text in enumerate(SCRIPTS)}  # what the sampler replays
    turns = engine.generate(reqs)
    engine.close()
    lengths = set()
    for seed, (req, turn) in enumerate(zip(reqs, turns, strict=True)):
        sampled = [i for i, k in zip(turn.completion_ids, turn.kinds, strict=True) if k != "tool_output"]
        assert sampled == scripts[seed] and turn.finish_reason == "length"
        assert [k for k in turn.kinds if k != "tool_output"] == expected_kinds(tok, scripts[seed])
        assert len(turn.tool_calls) == SCRIPTS[seed].count("<code>")
        for call in turn.tool_calls:
            out = turn.completion_ids[call.start : call.end]
            assert all(k == "tool_output" for k in turn.kinds[call.start : call.end])
            assert tok.decode(out).startswith("<output>\n") and tok.decode(out).endswith("</output>\n")
            assert turn.kinds[call.start - 1] == "tool_call", (
                "the token closing </code> keeps the call's kind"
            )
            lengths.add(call.end - call.start)
        kinds = ["prompt"] * len(req.prompt_ids) + turn.kinds
        assert turn.routes == shift(kinds, route_of)
        ids = req.prompt_ids + turn.completion_ids
        forced = teacher_forced_logprobs(model, ids, turn.routes, 0.7)[len(req.prompt_ids) - 1 :]
        for got, want, kind in zip(turn.logprobs, forced, turn.kinds, strict=True):
            assert math.isnan(got) if kind == "tool_output" else abs(got - want) < 1e-4
    assert len(lengths) >= 2, "tool outputs of different lengths in different rows"
    assert {r for t in turns for r in t.routes} == {0, 1, 2}, "three distinct adapters"


@pytest.mark.parametrize("spare", [0, 7])
def test_a_row_fills_its_cache_to_the_last_column(tiny, spare):
    """The cache holds a row's positions but the last (sampled, never fed). A row whose tool output is cut to
    the room left, and one that samples to its length, keep the teacher-forced log-probs: in a cache with no
    column to spare (spare 0: the fed positions a multiple of 8), and with the fed positions one past a
    multiple of 8 (spare 7: a cache sized one column short would round to 8 columns short and fail)."""
    model, tok = tiny
    prompt = prompt_ids(tok, "Question: what is it?\n")
    script = prompt_ids(tok, SCRIPTS[0])
    closed = next(c for c in range(len(script)) if tok.decode(script[: c + 1]).endswith("</code>")) + 1
    fed = (8 - spare) % 8 or 8  # the positions a row feeds (prompt + completion - 1), modulo 8, 8 for 0
    kept = (fed - len(prompt) - closed) % 8 or 8  # tool-output tokens kept
    plain = [script[i % len(script)] for i in range((fed - len(prompt) + 1) % 8 + 16)]
    cases = [
        (GenerationRequest(prompt, SamplingParams(seed=0, max_new_tokens=len(script)), tool="echo",
                           max_total_tokens=len(prompt) + closed + kept + 1), script),
        (GenerationRequest(prompt, SamplingParams(seed=0, max_new_tokens=len(plain), ignore_eos=True)), plain),
    ]  # fmt: skip
    for req, tokens in cases:
        engine = Engine(
            model, tok, max_batch=1, tools={"echo": EchoTool()}, sampler=scripted_sampler({0: tokens})
        )
        (turn,) = engine.generate([req])
        engine.close()
        total = len(prompt) + len(turn.completion_ids)
        assert turn.finish_reason == "length" and (total - 1) % 8 == fed % 8
        assert engine.cache.capacity == total - 1 + spare
        if req.tool is not None:
            (call,) = turn.tool_calls
            assert call.start == closed and call.end - call.start == kept
        forced = teacher_forced_logprobs(model, prompt + turn.completion_ids, [-1] * total, 1.0)
        for got, want, kind in zip(turn.logprobs, forced[len(prompt) - 1 :], turn.kinds, strict=True):
            assert math.isnan(got) if kind == "tool_output" else abs(got - want) < 1e-4


# ---- batch invariance and continuous batching ----------------------------------------------------------


def near_tie(logp: torch.Tensor, params: SamplingParams, counter: int, eps: float = 1e-5) -> bool:
    """Whether a 1e-6 difference in logits between batch shapes can legitimately flip this draw: the row's
    uniform fell within `eps` (of the total mass) of a CDF boundary, or, with top-k/top-p (the sampler walks
    the kept tokens in descending order), two tokens near the walk's end are within `eps` of swapping
    places, or a token sits within `eps` of the top-p cut (kept or dropped, it changes the mass)."""
    probs = logp.double().exp()
    u = float(counter_uniform(torch.tensor([params.seed]), torch.tensor([counter])))
    if params.top_k == 0 and params.top_p >= 1:
        cdf = probs.cumsum(-1)
        return bool(((cdf - u * float(cdf[-1])).abs() < eps * float(cdf[-1])).any())
    values = probs.sort(descending=True).values
    total = float(values.sum())
    keep = torch.ones_like(values, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    before = values.cumsum(0) - values
    if params.top_p < 1:
        keep &= before < params.top_p * total
        if bool(((before - params.top_p * total).abs() < eps * total).any()):
            return True
    kept = values[keep]
    cdf = kept.cumsum(0)
    target = u * float(cdf[-1])
    if bool(((cdf - target).abs() < eps * float(cdf[-1])).any()):
        return True
    # the drawn place's token could swap with a neighbour (the first dropped one included)
    k = int(
        torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True).clamp(max=len(kept) - 1)
    )
    near = values[max(k - 1, 0) : k + 2]
    return bool(((near[:-1] - near[1:]).abs() < eps * total).any())


def assert_same_or_near_tie(model, req: GenerationRequest, expected, got) -> str | None:
    """Identical tokens and log-probs within 64 fp32 ulps of the largest logit, or a divergence explained by
    a near-tie (returned as a message for the caller to report); anything else fails. Log-probs of the same
    tokens computed at other batch shapes differ by the rounding of GEMMs and reductions split otherwise,
    summed over the layers, at the scale of the logits: over 12 adapter draws of the scheduler test (tiny
    llama, max |logit| 21) the worst was 7-9e-5, ~30-35 ulps (a fixed 1e-4 failed now and then)."""
    n = min(len(expected.completion_ids), len(got.completion_ids))
    j = next((i for i in range(n) if expected.completion_ids[i] != got.completion_ids[i]), None)
    ids = req.prompt_ids + expected.completion_ids
    kinds = ["prompt"] * len(req.prompt_ids) + expected.kinds
    routes = shift(kinds, req.route_of or dict.fromkeys(ALL_KINDS, -1))[: len(ids)]
    with torch.no_grad():
        kwargs = {"routes": torch.tensor([routes])} if hasattr(model, "_rolerl_route_state") else {}
        atol = ulp_tol(model(torch.tensor([ids]), **kwargs).logits.float() / req.sampling.scale, 64)
    if j is None:
        assert expected.completion_ids == got.completion_ids
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=atol, rtol=0
        )
        return None
    torch.testing.assert_close(
        torch.tensor(got.logprobs[:j]), torch.tensor(expected.logprobs[:j]), atol=atol, rtol=0
    )
    ids = req.prompt_ids + expected.completion_ids[:j]
    kinds = ["prompt"] * len(req.prompt_ids) + expected.kinds[:j] + [expected.kinds[j]]
    routes = shift(kinds, req.route_of or dict.fromkeys(ALL_KINDS, -1))[: len(ids)]
    with torch.no_grad():
        kwargs = {"routes": torch.tensor([routes])} if hasattr(model, "_rolerl_route_state") else {}
        logits = model(torch.tensor([ids]), **kwargs).logits[0, -1].float()
    logp = torch.log_softmax(logits / req.sampling.scale, -1)
    assert not req.sampling.greedy and near_tie(logp, req.sampling, j), f"diverged at {j} without a near-tie"
    return f"seed {req.sampling.seed}: near-tie at token {j}"


def test_request_alone_equals_request_in_busy_batch(tiny):
    model, tok = tiny
    probe = GenerationRequest(
        prompt_ids(tok, "The weather today"), SamplingParams(seed=123, max_new_tokens=24)
    )
    alone = Engine(model, tok, max_batch=1).generate([probe])[0]
    rng = random.Random(0)
    others = [
        GenerationRequest(
            [rng.randrange(100, 20000) for _ in range(rng.randint(1, 30))],
            SamplingParams(
                seed=i, max_new_tokens=rng.randint(1, 40), top_k=rng.choice([0, 50]), temperature=0.9
            ),
        )
        for i in range(11)
    ]
    busy = Engine(model, tok, max_batch=8).generate([*others[:5], probe, *others[5:]])[5]
    tie = assert_same_or_near_tie(model, probe, alone, busy)
    if tie:
        pytest.skip(f"{tie}: divergence is legitimate (reported, not a failure)")


@pytest.mark.slow  # 200 requests, each also run solo: ~1 min per architecture on 2 cores
def test_continuous_batching_200_requests_16_slots_equal_solo(tiny):
    model, tok = tiny
    rng = random.Random(1)
    reqs = [
        GenerationRequest(
            [rng.randrange(100, 40000) for _ in range(rng.choice([1, 3, 8, 20, 45]))],
            SamplingParams(
                seed=i,
                greedy=i % 3 == 0,
                max_new_tokens=rng.choice([1, 2, 5, 17, 40]),
                top_p=rng.choice([1.0, 0.9]),
            ),
        )
        for i in range(200)
    ]
    engine = Engine(model, tok, max_batch=16)
    batched = engine.generate(reqs)
    assert engine.stats["steps"] < sum(r.sampling.max_new_tokens for r in reqs) / 8, "slots must be reused"
    solo_engine = Engine(model, tok, max_batch=1)
    ties = []
    for req, turn in zip(reqs, batched, strict=True):
        solo = solo_engine.generate([req])[0]
        assert len(turn.completion_ids) == req.sampling.max_new_tokens or turn.finish_reason == "eos"
        ties.append(assert_same_or_near_tie(model, req, solo, turn))
    ties = [t for t in ties if t]
    assert len(ties) <= 4, f"too many near-ties to be chance: {ties}"
    if ties:
        print(f"near-ties (legitimate divergences): {ties}")


def generate_with_widths(model, tok, reqs, max_batch):
    """The engine's turns for `reqs`, the number of positions every forward it ran computed (padding
    included), and whether it ran the lean decoder (whose flat forwards compute real tokens only)."""
    widths = []
    hook = model.get_input_embeddings().register_forward_pre_hook(  # every forward embeds its ids
        lambda _m, args: widths.append(args[0].numel())
    )
    try:
        engine = Engine(model, tok, max_batch=max_batch)
        return engine.generate(reqs), widths, engine.lean is not None
    finally:
        hook.remove()


def test_group_sharing_a_prompt_prefills_it_once_and_equals_solo(tiny):
    """A GRPO group: 6 samples of one prompt (plus one other prompt, and one with the same ids but another
    route) are admitted together; each distinct (ids, routes) prompt runs through the model once, and every
    sample equals its solo run."""
    model, tok = tiny
    rolerl.add_adapters(model, ["a"], rank=4)
    randomize_adapters(model, seed=3, std=0.1)
    ids, other = prompt_ids(tok, "Solve: 12 times 7, then add 3."), prompt_ids(tok, "Hello there, friend")
    on, off = dict.fromkeys(ALL_KINDS, 0), None
    reqs = [GenerationRequest(ids, SamplingParams(seed=i, max_new_tokens=12), route_of=on) for i in range(6)]
    reqs += [
        GenerationRequest(other, SamplingParams(seed=6, max_new_tokens=12), route_of=on),
        GenerationRequest(ids, SamplingParams(seed=7, max_new_tokens=12), route_of=off),
    ]
    turns, widths, flat = generate_with_widths(model, tok, reqs, max_batch=8)
    assert len(other) < len(ids)
    # one prefill row per distinct prompt (the lean decoder's flat layout computes no padding)
    assert widths[0] == (2 * len(ids) + len(other) if flat else 3 * len(ids))
    assert all(w == 8 for w in widths[1:12])  # then all 8 rows decode
    assert len({tuple(t.completion_ids) for t in turns[:6]}) > 1  # each sample drew its own tokens
    solo = Engine(model, tok, max_batch=1)
    for req, turn in zip(reqs, turns, strict=True):
        assert assert_same_or_near_tie(model, req, solo.generate([req])[0], turn) is None


def common_start(*prompts: list[int]) -> int:
    return next((j for j in range(min(map(len, prompts))) if len({p[j] for p in prompts}) > 1), 0)


def test_prompts_that_start_alike_prefill_the_start_once_and_equal_solo(tiny):
    """Evaluation and imitation prompts behind one system prompt: the start runs once per (ids, routes)
    set, all sets in one forward, then each row feeds the rest of its prompt; every row equals its solo
    run."""
    model, tok = tiny
    rolerl.add_adapters(model, ["a", "b"], rank=4)
    randomize_adapters(model, seed=3, std=0.1)
    system = prompt_ids(tok, "You are a careful assistant. Solve the problem, then put the answer in tags.")
    questions = [" What is 12 times 7?", " Name a prime above 40.", " Count to five, slowly.", " Spell cat."]
    a, b = dict.fromkeys(ALL_KINDS, 0), dict.fromkeys(ALL_KINDS, 1)
    prompts = [system + prompt_ids(tok, q) for q in questions]
    reqs = [
        GenerationRequest(p, SamplingParams(seed=i, max_new_tokens=10), route_of=a)
        for i, p in enumerate(prompts)
    ]
    # the same start under the other adapter is another set (its keys and values differ)
    reqs += [
        GenerationRequest(p, SamplingParams(seed=9 + i, max_new_tokens=10), route_of=b)
        for i, p in enumerate(prompts[:2])
    ]
    hello = prompt_ids(tok, "Hello there, my friend")  # starts otherwise: prefilled whole
    reqs.append(GenerationRequest(hello, SamplingParams(seed=20, max_new_tokens=10), route_of=a))
    n_a, n_b = common_start(*prompts), common_start(*prompts[:2])
    assert n_a >= len(system) and n_b >= n_a  # the start, and what the two questions also share
    turns, widths, flat = generate_with_widths(model, tok, reqs, max_batch=8)
    rests = [len(p) - n_a for p in prompts] + [len(p) - n_b for p in prompts[:2]] + [len(hello)]
    # the two starts at once, then every row's own rest (padded to the longest unless flat)
    assert widths[:2] == ([n_a + n_b, sum(rests)] if flat else [2 * n_b, 7 * max(rests)])
    assert all(w == 7 for w in widths[2:10])  # then all 7 rows decode
    solo = Engine(model, tok, max_batch=1)
    for req, turn in zip(reqs, turns, strict=True):
        assert assert_same_or_near_tie(model, req, solo.generate([req])[0], turn) is None
        assert turn.routes[: len(req.prompt_ids)] == solo.generate([req])[0].routes[: len(req.prompt_ids)]


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the engine's own decoder, HF's forward
def test_a_call_continuing_a_finished_one_feeds_only_what_is_new(tiny, kernels):
    """A multi-turn workflow's next call (the turn's exact ids, then a new message) copies the finished
    row's keys and values (`PrefixStore`) and computes only the message: MSARL's reasoner once prefilled its
    whole conversation at every turn. A call under other routes shares nothing; a fresh prompt behind the
    same system prompt shares that; every call equals a run without the store; weights changed in place
    since make every kept row stale."""
    model, tok = tiny
    rolerl.add_adapters(model, ["a", "b"], rank=4)
    randomize_adapters(model, seed=3, std=0.1)
    a, b = dict.fromkeys(ALL_KINDS, 0), dict.fromkeys(ALL_KINDS, 1)
    system = prompt_ids(tok, "You are a careful assistant. Solve the problem, then put the answer in tags.")
    firsts = [system + prompt_ids(tok, q) for q in (" What is 12 times 7?", " Name a prime above 40.")]
    sampling = [SamplingParams(seed=i, max_new_tokens=10) for i in range(4)]
    engine, plain = (Engine(model, tok, max_batch=8, kernels=kernels, prefix_cache=n) for n in (32768, 0))
    first = engine.generate([GenerationRequest(p, sampling[i], route_of=a) for i, p in enumerate(firsts)])
    assert engine.stats["kept_hits"] == 0 and len(engine.kept.entries) == 2
    result = prompt_ids(tok, " Result: 84. Go on.")
    fresh = system + prompt_ids(tok, " Spell cat.")
    reqs = [GenerationRequest(t.prompt_ids + t.completion_ids + result, sampling[i], route_of=a)
            for i, t in enumerate(first)]  # fmt: skip
    reqs.append(GenerationRequest(reqs[0].prompt_ids, sampling[2], route_of=b))  # other routes: nothing kept
    reqs.append(GenerationRequest(fresh, sampling[3], route_of=a))
    widths = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, x: widths.append(x[0].numel()))
    try:
        turns = engine.generate(reqs)
    finally:
        hook.remove()
    # each continuation reuses every position its turn fed (all but the last sampled token), the fresh
    # prompt the start it shares with them (the system prompt and more: a kept row's longest match)
    fed = [len(t.prompt_ids) + len(t.completion_ids) - 1 for t in first]
    shared = max(common_start(fresh, p) for p in firsts)
    assert shared >= len(system)
    assert engine.stats["kept_hits"] == 3 and engine.stats["kept_positions"] == sum(fed) + shared
    if engine.lean is not None:  # flat forwards: real tokens only, so the first forward is the new tokens
        new = [len(r.prompt_ids) - n for r, n in zip(reqs, [*fed, 0, shared], strict=True)]
        assert widths[0] == sum(new)
    for req, turn in zip(reqs, turns, strict=True):
        assert assert_same_or_near_tie(model, req, plain.generate([req])[0], turn) is None
    assert plain.stats["kept_hits"] == 0 and plain.kept is None
    # the continued rows are dropped (their continuations hold all of them): 6 finished calls, 4 kept...
    assert len(engine.kept.entries) == 6 - 2
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():  # ... until the adapters change in place (an optimizer step): all stale
        lora_b.add_(0.05)
    again = engine.generate([reqs[0]])
    assert engine.stats["kept_hits"] == 3 and len(engine.kept.entries) == 1
    assert assert_same_or_near_tie(model, reqs[0], plain.generate([reqs[0]])[0], again[0]) is None
    lora_b.data = lora_b.data * 1.5  # new storage, no in-place version bump: stale too
    again = engine.generate([reqs[0]])
    assert engine.stats["kept_hits"] == 3 and len(engine.kept.entries) == 1
    assert assert_same_or_near_tie(model, reqs[0], plain.generate([reqs[0]])[0], again[0]) is None


def test_the_prefix_store_keeps_the_longest_matching_start_within_its_budget():
    """`PrefixStore` by hand: the longest start shared in ids and routes wins (the newest of equals), a
    match never takes the position the request must feed, short starts are not worth it, and the least
    recently used rows go first once more than the budget is kept."""
    from transformers import LlamaConfig

    from rolerl.rollout.kv import MIN_KEPT, KVCache, PrefixStore

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    cache = KVCache(config, slots=2, capacity=40, dtype=torch.float32, device="cpu")
    cache.reach(40)
    for layer in (*cache.k, *cache.v):
        layer.copy_(torch.randn_like(layer))
    store = PrefixStore(budget=50)
    row = list(range(100, 120))
    store.put(cache, 0, row, [0] * 20)  # entry 0
    store.put(cache, 1, row[:12] + [7] * 8, [0] * 20)  # entry 1: the first 12 alike
    assert store.positions == 40
    assert store.match(row + [1, 2], [0] * 22, limit=21) == (0, 20)
    assert store.match(row, [0] * 20, limit=19) == (0, 19)  # the last position is the request's to feed
    assert store.match(row[:12] + [5], [0] * 13, limit=12) == (1, 12)  # equals: the newest
    assert store.match(row, [0] * 10 + [1] * 10, limit=19) == (1, 10)  # routes differ from position 10
    assert store.match(row[: MIN_KEPT - 1] + [9] * 5, [0] * 12, limit=11) is None
    assert store.match(row, [1] * 20, limit=19) is None
    fresh = KVCache(config, slots=1, capacity=40, dtype=torch.float32, device="cpu")
    store.load(1, 15, fresh, 0)  # entry 1 is now the most recently used
    for mine, theirs in ((fresh.k, cache.k), (fresh.v, cache.v)):
        assert all(torch.equal(m[0, :, :15], t[1, :, :15]) for m, t in zip(mine, theirs, strict=True))
    store.put(cache, 0, row[:15], [0] * 15)  # entry 2: 55 positions kept > 50, so entry 0 goes
    assert list(store.entries) == [1, 2] and store.positions == 35
    store.put(cache, 0, [3] * (MIN_KEPT - 1), [0] * (MIN_KEPT - 1))  # too short to keep
    assert list(store.entries) == [1, 2]


def test_bad_requests_are_rejected(tiny):
    model, tok = tiny
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match="calls tool 'python'; engine tools: \\[\\]"):
        engine.submit(GenerationRequest([1, 2], tool="python"))
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        GenerationRequest([])
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="model has none"):
        engine.generate([GenerationRequest([5, 6], route_of={"prompt": 0, "reasoning": 0})])


# ---- real tools ---------------------------------------------------------------------------------------


def test_real_sandbox_calls_errors_and_tool_limit(tiny, sandbox):
    model, tok = tiny
    texts = [
        "Compute.<code>print(6 * 7)</code>ok",
        "Oops<code>1 / 0</code>hmm",
        "Twice<code>print(1)</code>and<code>print(2)</code>never",
    ]
    scripts = {seed: prompt_ids(tok, t) for seed, t in enumerate(texts)}
    engine = Engine(model, tok, max_batch=3, tools={"python": sandbox}, sampler=scripted_sampler(scripts))
    reqs = [
        GenerationRequest(
            prompt_ids(tok, "Q:"),
            SamplingParams(seed=seed, max_new_tokens=len(s)),
            tool="python",
            max_tool_calls=1,
        )
        for seed, s in scripts.items()
    ]
    ok, error, limited = engine.generate(reqs)
    engine.close()
    assert ok.tool_calls[0].output.strip() == "42" and not ok.tool_calls[0].error
    assert "42" in tok.decode(ok.completion_ids) and ok.finish_reason == "length"
    assert error.tool_calls[0].error and "ZeroDivisionError" in error.tool_calls[0].output
    assert "ZeroDivisionError" in tok.decode(error.completion_ids), "the model sees the traceback"
    assert limited.finish_reason == "tool_limit" and len(limited.tool_calls) == 1
    assert tok.decode(limited.completion_ids).endswith("</code>"), "the turn ends at the call over the limit"


def test_stop_strings_truncation_budget_and_empty_call(tiny):
    model, tok = tiny
    texts = ["Think<code>long()</code>more", "Say <answer>7</answer> then more text", "x<code>  </code>y"]
    scripts = {seed: prompt_ids(tok, t) for seed, t in enumerate(texts)}

    class LongTool:
        name, description = "long", "prints a lot"

        def run(self, args: str) -> ToolResult:
            return ToolResult(stdout="word " * 500)

    engine = Engine(model, tok, max_batch=3, tools={"long": LongTool()}, sampler=scripted_sampler(scripts))
    reqs = [
        GenerationRequest(
            prompt_ids(tok, "Q:"),
            SamplingParams(seed=seed, max_new_tokens=len(s), stop=("</answer>",)),
            tool="long",
            tool_output_tokens=20,
        )
        for seed, s in scripts.items()
    ]
    long, stopped, empty = engine.generate(reqs)
    engine.close()
    call = long.tool_calls[0]
    assert call.output.endswith("[output truncated]\n") and call.output.count("word") <= 20
    assert call.end - call.start <= 20 + 16, "spliced output is cut to the token budget"
    assert stopped.finish_reason == "stop" and tok.decode(stopped.completion_ids).endswith("</answer>")
    assert stopped.kinds[-1] == "answer", "the closing tag's token keeps the answer kind"
    assert empty.tool_calls[0].error and "empty tool call" in empty.tool_calls[0].output


def test_bf16_engine_matches_teacher_forcing_loosely(tokenizer):
    model, tok = rolerl.tiny_model("qwen3", dtype=torch.bfloat16, tokenizer=tokenizer)
    req = GenerationRequest(prompt_ids(tok, "Hello there"), SamplingParams(seed=3, max_new_tokens=16))
    turn = Engine(model, tok).generate([req])[0]
    assert len(turn.completion_ids) == 16
    forced = teacher_forced_logprobs_base(model, req.prompt_ids + turn.completion_ids)[
        len(req.prompt_ids) - 1 :
    ]
    # bf16 rounding differs between a cached decode and a full forward: rollout and recompute agree only
    # in fp32 (DESIGN), which is why the trainer can log and correct the mismatch
    assert max(abs(a - b) for a, b in zip(turn.logprobs, forced, strict=True)) < 0.25


def teacher_forced_logprobs_base(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]


def test_generate_cli_prints_tokens_kinds_routes_as_json(tiny, tmp_path, capsys):
    import json

    from rolerl.cli import main

    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    argv = ["generate", "--model", str(tmp_path / "m"), "--raw", "--prompt", "1, 2, 3,", "--greedy"]
    assert main([*argv, "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["completion_ids"]) == len(out["kinds"]) == len(out["routes"]) == len(out["logprobs"]) == 6
    assert out["completion_ids"] == hf_greedy(model, prompt_ids(tok, "1, 2, 3,"), 6)
    assert set(out["routes"]) == {-1} and out["finish_reason"] == "length"


def test_a_prompt_that_leaves_little_room_is_warned_about_once(tokenizer, caplog):
    import logging

    model, _ = rolerl.tiny_model("llama", tokenizer=tokenizer)
    engine = Engine(model, tokenizer, max_batch=2, max_len=12)
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    with caplog.at_level(logging.WARNING, logger="rolerl.rollout.engine"):
        turns = engine.generate([GenerationRequest(list(range(1, 9)), sampling) for _ in range(2)])
    assert [t.finish_reason for t in turns] == ["length", "length"]
    assert [len(t.completion_ids) for t in turns] == [4, 4]
    (record,) = caplog.records
    assert "leaves room for 4 of its 8 new tokens (max_len 12)" in record.getMessage()
    assert Engine(model, tokenizer).max_len == model.config.max_position_embeddings
