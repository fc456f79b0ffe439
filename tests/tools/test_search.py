"""Retrieval: corpus loading, BM25 recall of HotpotQA supporting paragraphs, the on-disk index cache, the
Search-R1 wire protocol (our server against our client on loopback), and failures as tool errors."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolerl.tasks.qa import qa_task
from rolerl.tools.base import Tool
from rolerl.tools.retrieval_http import HTTPRetriever, RetrieverServer
from rolerl.tools.search import (
    BM25Retriever,
    Passage,
    RetrieverError,
    SearchTool,
    format_passages,
    load_corpus,
    search_tool,
)

HOTPOT_CORPUS = "qa/wiki_corpus/hotpotqa_ircot500_contexts_corpus.jsonl.gz"
SMALL = [
    {"id": "p0", "title": "Paris", "text": "Paris is the capital of France."},
    {"id": "p1", "title": "Berlin", "text": "Berlin is the capital of Germany."},
    {"id": "p2", "title": "Rome", "text": "Rome is the capital of Italy and has the Colosseum."},
]


@pytest.fixture(scope="module")
def hotpot(shared_data, tmp_path_factory):
    """`(retriever, build seconds, cache directory)` over the IRCoT-500 paragraph corpus."""
    cache = tmp_path_factory.mktemp("bm25")
    t0 = time.perf_counter()
    retriever = BM25Retriever(shared_data / HOTPOT_CORPUS, cache_dir=cache)
    return retriever, time.perf_counter() - t0, cache


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SMALL))
    return BM25Retriever(path, cache_dir=None)


def test_format_passages_is_search_r1s():
    ps = [Passage("1", "Kate Millett", "She attended Oxford."), Passage("2", "Oxford", "A city.")]
    assert (
        format_passages(ps)
        == "Doc 1(Title: Kate Millett) She attended Oxford.\nDoc 2(Title: Oxford) A city.\n"
    )
    assert format_passages(ps, "plain") == "[1] Kate Millett\nShe attended Oxford.\n\n[2] Oxford\nA city.\n"
    with pytest.raises(ValueError, match=r"fmt='html'; allowed: \['search_r1', 'plain'\]"):
        format_passages(ps, "html")  # type: ignore[arg-type]


def test_load_corpus_formats(shared_data, tmp_path):
    wiki = load_corpus(shared_data / "qa/wiki_corpus/hipporag_2wikimultihopqa_corpus.json.gz")
    assert len(wiki) == 6119 and wiki[0].id == "0" and wiki[0].title == "Teutberga"  # ids generated
    hp = load_corpus(shared_data / HOTPOT_CORPUS)
    assert len(hp) == 4858 and (hp[1].id, hp[1].title) == ("hp1", "Shirley Temple")
    path = tmp_path / "wiki18.jsonl.gz"  # Search-R1's wiki-18 rows: the title is contents' first line
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"id": "0", "contents": '"Aaron"\nAaron is a prophet.'}) + "\n")
    assert load_corpus(path) == [Passage("0", '"Aaron"', "Aaron is a prophet.")]
    (tmp_path / "bad.jsonl").write_text('{"title": "t", "text": "x"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a passage needs string 'text'"):
        load_corpus(tmp_path / "bad.jsonl")
    (tmp_path / "dup.jsonl").write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(ValueError, match="not unique"):
        load_corpus(tmp_path / "dup.jsonl")


def test_bm25_top5_finds_a_supporting_paragraph_for_most_hotpot_questions(hotpot, shared_data):
    retriever, _, _ = hotpot
    examples = qa_task("hotpotqa", shared_data).dataset("dev_ircot500").examples
    hits = retriever.search([e.question for e in examples], k=5)
    found = [
        any((p.title, p.text) in {(s["title"], s["text"]) for s in e.meta["supporting"]} for p in ps)
        for e, ps in zip(examples, hits, strict=True)
    ]
    share = sum(found) / len(found)
    assert share >= 0.85, f"top-5 holds a supporting paragraph for {share:.1%} of 500 questions"
    assert all(len(ps) == 5 and ps[0].score >= ps[-1].score > 0 for ps in hits)


def test_index_cache_is_reused_and_a_corrupt_one_rebuilt(hotpot, shared_data, caplog):
    first, build_s, cache = hotpot
    assert not first.cache_hit and (first.cache_path / "meta.json").is_file()
    queries = ["Kate Millett university", "Corliss Archer radio program"]
    t0 = time.perf_counter()
    again = BM25Retriever(shared_data / HOTPOT_CORPUS, cache_dir=cache)
    hit_s = time.perf_counter() - t0
    assert again.cache_hit and again.search(queries, 3) == first.search(queries, 3)
    print(f"BM25 index of 4858 passages: built in {build_s:.2f} s, loaded from cache in {hit_s:.2f} s")

    data = again.cache_path / "data.csc.index.npy"
    data.write_bytes(data.read_bytes()[:-16] + b"\0" * 16)  # same size, damaged tail
    with caplog.at_level(logging.WARNING, logger="rolerl.tools.search"):
        rebuilt = BM25Retriever(shared_data / HOTPOT_CORPUS, cache_dir=cache)
    assert not rebuilt.cache_hit and "unusable" in caplog.text and "rebuilding" in caplog.text
    assert rebuilt.search(queries, 3) == first.search(queries, 3)
    (again.cache_path / "meta.json").write_text("{trunc")
    assert not BM25Retriever(shared_data / HOTPOT_CORPUS, cache_dir=cache).cache_hit
    assert BM25Retriever(shared_data / HOTPOT_CORPUS, cache_dir=cache).cache_hit  # repaired on disk
    assert [p.name for p in cache.iterdir()] == [first.cache_path.parent.name]  # no temporary dirs left


def test_search_edge_cases_and_threads(small, hotpot):
    assert small.search(["", "the of and", "zzyzx"], 2) == [[], [], []]  # nothing known: no passages
    (top,) = small.search(["capital of Italy Colosseum"], 10)  # k beyond the corpus is clamped
    assert top[0].id == "p2" and len(top) == 3
    with pytest.raises(TypeError, match="list of query strings"):
        small.search("capital", 1)  # type: ignore[arg-type]
    retriever = hotpot[0]
    queries = [
        f"{w} film director born" for w in ("Scott", "Ed Wood", "Kiss and Tell", "Shirley", "Corliss")
    ] * 8
    expected = [retriever.search([q], 5)[0] for q in queries]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda q: retriever.search([q], 5)[0], queries))
    assert got == expected


# ---- the tool, the server and the client -----------------------------------------------------------------


@pytest.fixture
def server(small):
    srv = RetrieverServer(small, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_search_tool_over_bm25(small):
    tool = SearchTool(small, k=2)
    assert isinstance(tool, Tool) and tool.name == "search"
    result = tool.run("  capital of\nGermany ")
    assert result.ok and result.stdout.startswith("Doc 1(Title: Berlin) Berlin is the capital of Germany.\n")
    assert tool.run("zzyzx").stdout == "No passages matched the query.\n"
    assert tool.run("   ").exit_code == 2
    assert SearchTool(small, k=3, max_output_chars=20).run("capital").truncated
    with pytest.raises(ValueError, match="exactly one of corpus"):
        search_tool()


def test_server_and_client_agree(server, small):
    client = HTTPRetriever(server.url, timeout_s=5)
    queries = ["capital of France", "Colosseum", "zzyzx"]
    assert client.search(queries, 2) == small.search(queries, 2)  # ids, titles, texts and scores
    status, body = _post(server.url, json.dumps({"queries": ["Colosseum"], "topk": 1}).encode())
    doc = {"id": "p2", "contents": "Rome\nRome is the capital of Italy and has the Colosseum."}
    assert (status, body) == (200, {"result": [[doc]]})  # without return_scores: documents only
    status, body = _post(server.url, json.dumps({"queries": ["Colosseum"], "return_scores": True}).encode())
    assert body["result"][0][0]["document"] == doc and body["result"][0][0]["score"] > 0
    tool = search_tool(url=server.url, k=1, max_attempts=2)
    assert tool.retriever.max_attempts == 2  # type: ignore[attr-defined]
    assert (
        tool.run("Colosseum").stdout
        == "Doc 1(Title: Rome) Rome is the capital of Italy and has the Colosseum.\n"
    )


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"topk": 3}', "'queries' must be a non-empty list of strings"),
        (b'{"queries": []}', "'queries' must be a non-empty list of strings"),
        (b'{"queries": ["a", 1]}', "'queries' must be a non-empty list of strings"),
        (b'{"queries": ["a"], "topk": [3]}', r"'topk'=[3]; allowed: an integer in 1..1000"),
        (b'{"queries": ["a"], "topk": 0}', "'topk'=0"),
        (b'{"queries": ["a"], "return_scores": "yes"}', "'return_scores'='yes'"),
    ],
)
def test_server_rejects_bad_requests(server, body, error):
    status, answer = _post(server.url, body)
    assert status == 400 and error in answer["error"]


def test_server_wrong_path_and_method(server):
    assert _post(server.url.replace("/retrieve", "/search"), b"{}")[0] == 404
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url, timeout=5)
    assert info.value.code == 405


class _Broken:
    def search(self, queries, k):
        raise RuntimeError("index on fire")


def test_http_500_is_a_tool_error():
    srv = RetrieverServer(_Broken(), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        client = HTTPRetriever(srv.url, timeout_s=5, backoff_s=0.01)  # a 5xx is retried: 5 attempts
        with pytest.raises(RetrieverError, match=r"failed after 5 attempt\(s\).*HTTP 500.*index on fire"):
            client.search(["q"], 3)
        result = SearchTool(client).run("who wrote hamlet")
    finally:
        srv.shutdown()
        srv.server_close()
    assert not result.ok and result.exit_code == 1 and not result.timed_out and result.tool_failed
    assert result.stdout == "" and "search failed" in result.stderr and "HTTP 500" in result.stderr
    assert "Doc 1" not in result.text()


def test_a_server_that_never_answers_times_out():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts connections; nobody ever reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/retrieve"
    try:
        client = HTTPRetriever(url, timeout_s=0.3)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="no answer within 0.3 s"):
            client.search(["q"], 3)
        assert time.perf_counter() - t0 < 3
        result = SearchTool(client).run("who wrote hamlet")
    finally:
        silent.close()
    assert not result.ok and result.timed_out and result.exit_code != 0 and result.tool_failed
    assert result.stdout == "" and "timed out" in result.stderr and result.wall_s >= 0.3


class _Stub(BaseHTTPRequestHandler):
    """Answers every POST with the class's canned `(status, body)`."""

    reply: tuple[int, bytes] = (200, b"")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = self.reply
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    ("body", "expect"),
    [  # Search-R1's own server: wiki-18 documents, the title quoted on contents' first line
        (
            {
                "result": [
                    [{"document": {"id": "7", "contents": '"Aaron"\nAaron is a prophet.'}, "score": 3.5}]
                ]
            },
            [[Passage("7", '"Aaron"', "Aaron is a prophet.", 3.5)]],
        ),
        ({"result": [[{"id": "7", "title": "T", "text": "x"}]]}, [[Passage("7", "T", "x")]]),  # no scores
        ({"result": []}, "one list per query"),
        ({"results": [[]]}, "need JSON"),
        ({"result": [[{"document": {"id": "7"}}]]}, "neither 'contents' nor 'text'"),
    ],
)
def test_client_reads_search_r1_answers_and_rejects_others(body, expect):
    handler = type("Stub", (_Stub,), {"reply": (200, json.dumps(body).encode())})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        client = HTTPRetriever(f"http://127.0.0.1:{srv.server_address[1]}/retrieve", timeout_s=5)
        if isinstance(expect, str):
            with pytest.raises(RetrieverError, match=expect):
                client.search(["q"], 1)
            assert not SearchTool(client).run("q").ok
        else:
            assert client.search(["q"], 1) == expect
    finally:
        srv.shutdown()
        srv.server_close()
