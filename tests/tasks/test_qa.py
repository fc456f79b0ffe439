"""QA benchmarks: SQuAD EM/F1 on hand-made cases, every loader on the real files (row counts from
shared/data/SOURCES.md), malformed rows reported and skipped, and the `QATask` contract."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from rolerl.tasks.base import Example, Task
from rolerl.tasks.qa import SEARCH_R1_TAGS, QATask, build_dataset, load_qa_file, qa_task
from rolerl.tasks.qa_metrics import exact_match, extract_answer, f1, normalize_answer

# ---- metrics ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normalised"),
    [
        ("The  Beatles!", "beatles"),
        ("U.S.A.", "usa"),
        ("an Apple a day", "apple day"),
        ("Theatre", "theatre"),  # "the" only as a whole word
        ("A+", ""),  # punctuation goes first, then "a" is an article: SQuAD cannot grade this gold
        ("  Rock\tand\nroll ", "rock and roll"),
    ],
)
def test_normalize_answer(text, normalised):
    assert normalize_answer(text) == normalised


def test_exact_match_articles_punctuation_and_several_golds():
    assert exact_match("the Beatles.", "Beatles") == 1.0
    assert exact_match("Beatles", ["The Rolling Stones", "the beatles"]) == 1.0  # any gold
    assert exact_match("Beatle", ["Beatles"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0  # no answer given
    with pytest.raises(ValueError, match="golds"):
        exact_match("x", [])


def test_f1_partial_overlap_by_hand():
    # pred tokens [quick, brown, fox] (the article goes), gold [quick, brown, dog, jumps]: 2 in common,
    # P = 2/3, R = 2/4, F1 = 2PR/(P+R) = (2/3)/(7/6) = 4/7
    assert f1("The quick brown fox", "quick brown dog jumps") == pytest.approx(4 / 7)
    # counted with multiplicity: [x, x, y] vs [x, y, y] share one x and one y: P = R = 2/3
    assert f1("x x y", "x y y") == pytest.approx(2 / 3)
    # the best gold wins: 4/7 against the first, 1.0 against the second
    assert f1("the quick brown fox", ["quick brown dog jumps", "Quick, brown fox!"]) == 1.0
    assert f1("cat", "dog") == 0.0
    assert f1("", "dog") == 0.0 and f1(None, "dog") == 0.0


def test_extract_answer_takes_the_last_closed_tag():
    assert extract_answer("<answer>a</answer> then <answer>\n Paris \n</answer>") == "Paris"
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>a</answer> <answer>unclosed") == "a"


# ---- loaders on the real files ---------------------------------------------------------------------------

# (benchmark, split, rows in the file per SOURCES.md, rows skipped, gold answers dropped). The skipped and
# dropped ones are golds that SQuAD normalisation turns into "": NQ "---" and ")" (rows), "A+" and "*"
# (one of several golds); EfficientQA ","; HotpotQA "The The" and "!!!" (rows).
FILES = [
    ("nq", "test", 3610, 2, 2),
    ("nq", "efficientqa", 1800, 0, 1),
    ("nq", "test_1k", 1000, 2, 1),
    ("triviaqa", "test_1k", 1000, 0, 0),
    ("popqa", "test_1k", 1000, 0, 0),
    ("bamboogle", "test", 125, 0, 0),
    ("hotpotqa", "dev", 7405, 2, 0),
    ("hotpotqa", "dev_ircot500", 500, 0, 0),
    ("2wiki", "dev", 12576, 0, 0),
    ("musique", "dev", 2417, 0, 0),
    ("musique", "train", 19938, 0, 0),
]


@pytest.mark.parametrize(("name", "split", "rows", "skipped", "dropped"), FILES)
def test_loader_row_counts(shared_data, name, split, rows, skipped, dropped):
    ds = qa_task(name, shared_data, split=split).dataset(split)
    assert (len(ds), len(ds.skipped), len(ds.dropped_golds)) == (rows - skipped, skipped, dropped)
    ids = [e.id for e in ds.examples]
    assert len(set(ids)) == len(ids) and ids[0].startswith(f"{name}/{split}/")
    assert all(e.question and e.meta["golds"] and e.answer == e.meta["golds"][0] for e in ds.examples)
    assert all(normalize_answer(g) for e in ds.examples for g in e.meta["golds"])


def test_loader_contents(shared_data):
    nq = qa_task("nq", shared_data).dataset("test").examples
    assert nq[0] == Example(
        "nq/test/0", "when was the last time anyone was on the moon", "14 December 1972 UTC"
    )
    assert nq[0].meta["golds"] == ["14 December 1972 UTC", "December 1972"]
    blood = next(e for e in nq if e.question == "what is the most common blood type in sweden")
    assert blood.meta["golds"] == ["AB+"]  # "A+" dropped, reported
    hp = qa_task("hotpotqa", shared_data).dataset("dev").examples
    assert hp[0].answer == "yes" and hp[0].meta["type"] == "comparison"
    assert hp[-1].id == "hotpotqa/dev/7404"  # ids are row indices: the two skipped rows keep theirs
    ircot = qa_task("hotpotqa", shared_data).dataset("dev_ircot500").examples
    assert all(len(e.meta["supporting"]) == 2 for e in ircot)  # SOURCES: every row has 2 supporting
    first = ircot[0]
    assert first.answer == "Chief of Protocol" and first.meta["source_id"] == "5a8c7595554299585d9e36b6"
    assert first.meta["supporting"][0]["title"] == "Shirley Temple"
    bam = qa_task("bamboogle", shared_data).dataset("test").examples
    assert bam[0].meta["source_id"] == "test_0" and bam[0].answer == "james madison"


def test_malformed_rows_are_reported_and_skipped(tmp_path, caplog):
    lines = [
        json.dumps({"question": "q0", "answer": ["good"]}),
        json.dumps({"answer": ["no question"]}),
        json.dumps({"question": "q2"}),
        json.dumps({"question": "q3", "answer": ""}),
        json.dumps({"question": "q4", "answer": ["---"]}),
        "{not json",
        json.dumps({"question": "q6", "answer": {"text": "a dict"}}),
        json.dumps({"question": "q7", "golden_answers": ["A+", "AB+"]}),
        json.dumps(["a", "list"]),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="rolerl.tasks.qa"):
        ds = load_qa_file(path, "bad", "test")
    assert [e.id for e in ds.examples] == ["bad/test/0", "bad/test/7"]
    assert ds.examples[1].meta["golds"] == ["AB+"]
    where = [s.where.rsplit(":", 1)[1] for s in ds.skipped]
    assert where == ["2", "3", "4", "5", "6", "7", "9"]
    reasons = " | ".join(s.reason for s in ds.skipped)
    for fragment in (
        "no 'question'",
        "no answer field",
        "'---'",
        "not valid JSON",
        "a dict",
        "not a JSON object",
    ):
        assert fragment in reasons
    assert len(ds.dropped_golds) == 1 and "'A+'" in ds.dropped_golds[0].reason
    assert "7 rows skipped" in caplog.text and "1 gold answers dropped" in caplog.text

    path.write_text(lines[1] + "\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_qa_file(path, "bad", "test")


def test_json_list_and_gzip_and_file_errors(tmp_path):
    import gzip

    path = tmp_path / "pairs.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump([{"question": "Who?", "answer": "Ann"}, {"question": "When?", "answer": 1969}], f)
    ds = load_qa_file(path, "pairs", "dev")
    assert [(e.id, e.answer) for e in ds.examples] == [("pairs/dev/0", "Ann"), ("pairs/dev/1", "1969")]
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(ValueError, match="need a JSON list"):
        load_qa_file(tmp_path / "obj.json", "x", "dev")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="allowed: .jsonl or .json"):
        load_qa_file(tmp_path / "rows.csv", "x", "dev")


# ---- QATask ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bamboogle(shared_data):
    return qa_task("bamboogle", shared_data)


def test_examples_are_deterministic_samples_without_replacement(bamboogle):
    assert isinstance(bamboogle, Task)
    a = bamboogle.examples("test", 50, seed=3)
    assert [e.id for e in a] == [e.id for e in bamboogle.examples("test", 50, seed=3)]
    assert len({e.id for e in a}) == 50
    assert [e.id for e in a] != [e.id for e in bamboogle.examples("test", 50, seed=4)]
    assert {e.id for e in bamboogle.examples("test", 125, seed=0)} == {
        f"bamboogle/test/{i}" for i in range(125)
    }
    assert bamboogle.size("test") == 125
    with pytest.raises(ValueError, match="has 125 examples"):
        bamboogle.examples("test", 126, seed=0)
    with pytest.raises(ValueError, match=r"split='dev'; allowed: \['test'\]"):
        bamboogle.examples("dev", 1, seed=0)


def test_reward_check_scores():
    ex = Example("t/0", "Who?", "The Beatles", {"golds": ["The Beatles", "Beatles band"]})
    em = QATask("t", {"test": lambda: None})  # type: ignore[dict-item]
    f1_task = QATask("t", {"test": lambda: None}, metric="f1")  # type: ignore[dict-item]
    right, partial = "<think>hm</think><answer> beatles </answer>", "<answer>the beatles rock band</answer>"
    assert em.reward(ex, right) == 1.0 and em.check(ex, right)
    assert em.reward(ex, partial) == 0.0 and not em.check(ex, partial)
    # [beatles, rock, band] vs [beatles, band]: 2 common, P = 2/3, R = 1, F1 = 0.8
    assert f1_task.reward(ex, partial) == pytest.approx(0.8) and not f1_task.check(ex, partial)
    assert em.scores(ex, partial) == {"em": 0.0, "f1": pytest.approx(0.8)}
    assert em.reward(ex, "beatles, no tags") == 0.0
    assert em.answer_of("<answer>The Beatles!</answer>") == "beatles" and em.answer_of("none") is None
    with pytest.raises(ValueError, match=r"metric='acc'; allowed: \['em', 'f1'\]"):
        QATask("t", {"test": lambda: None}, metric="acc")  # type: ignore[arg-type,dict-item]
    with pytest.raises(ValueError, match="prompt_style"):
        QATask("t", {"test": lambda: None}, prompt_style="chat")  # type: ignore[arg-type,dict-item]


def test_prompts(shared_data):
    ex = Example("nq/test/0", "who wrote hamlet", "Shakespeare")
    (msg,) = qa_task("nq", shared_data).search_prompt(ex)
    assert qa_task("nq", shared_data, prompt_style="search_r1").prompt(ex) == [msg]
    assert msg["role"] == "user" and msg["content"].endswith("Question: who wrote hamlet?\n")
    for tag in ("<think>", "<search>", "</search>", "<information>", "</information>", "<answer>"):
        assert tag in msg["content"]
    assert (SEARCH_R1_TAGS.tool_open, SEARCH_R1_TAGS.output_open) == ("<search>", "<information>")
    system, user = qa_task("nq", shared_data).prompt(ex)  # closed book by default
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": "who wrote hamlet"}


def test_qa_task_paths(shared_data, tmp_path):
    one = qa_task("nq", shared_data / "qa" / "nq_open" / "NQ-open.efficientqa.dev.1.1.jsonl", split="dev")
    assert one.splits == ["dev"] and one.size("dev") == 1800
    assert qa_task("nq", shared_data / "qa").splits == ["test", "test_1k", "efficientqa"]
    with pytest.raises(ValueError, match="unknown QA benchmark 'squad'"):
        qa_task("squad")
    with pytest.raises(ValueError, match=r"split\(s\) \['train'\] have no file"):
        qa_task("bamboogle", shared_data, split="train")
    with pytest.raises(FileNotFoundError, match="missing data file"):
        qa_task("bamboogle", tmp_path)
    with pytest.raises(FileNotFoundError, match="not a file, a directory or a Hugging Face dataset id"):
        qa_task("bamboogle", tmp_path / "nope" / "x.jsonl")


def test_hub_ids_load_lazily_with_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    task = qa_task("nq", "RUC-NLPIR/FlashRAG_datasets")  # nothing imported yet
    assert task.splits == ["train", "dev", "test"]
    with pytest.raises(ImportError, match=r"needs `datasets`.*pass a local file path"):
        task.dataset("test")

    def offline(dataset_id, config, split):
        raise ConnectionError("Couldn't reach the hub\nsecond line")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(
        ValueError, match=r"'RUC-NLPIR/FlashRAG_datasets' \(config 'nq', split 'test'\).*offline"
    ):
        qa_task("nq", "RUC-NLPIR/FlashRAG_datasets").dataset("test")

    rows = [{"id": "test_0", "question": "q?", "golden_answers": ["a1", "a2"]}]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: rows))
    (ex,) = qa_task("nq", "RUC-NLPIR/FlashRAG_datasets", split="test").dataset("test").examples
    assert (ex.id, ex.answer, ex.meta["golds"]) == ("nq/test/0", "a1", ["a1", "a2"])


def test_build_dataset_from_rows():
    ds = build_dataset("x", "dev", "mem", iter([("mem[0]", {"question_text": "q", "answers_objects": [
        {"spans": [], "number": "42", "date": {"day": "", "month": "", "year": ""}}]})]))  # fmt: skip
    assert ds.examples[0].answer == "42"
