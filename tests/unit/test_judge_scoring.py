"""LLM judges against a scripted OpenAI-compatible server: how each mode turns replies into verdicts
(hand-computed), position bias measured, the cache, retries, and every failure (bad replies, HTTP
errors, a server that drips bytes, a dead port) giving the documented result within its deadline;
the rank statistics of `judge eval` against hand values and a brute-force definition."""
import itertools
import json
import os
import re
import socket
import time

import pytest
import torch

from judge_util import ScriptedJudge, shown
from retrograd.config.schema import JudgeTable
from retrograd.data.prompts import Prompt
from retrograd.rl.judge import Judge, JudgeError, judge_metrics, read_score, read_scores, read_winner
from retrograd.rl.judge_eval import average_ranks, kendall_tau_b, spearman_rho


def make_judge(url, failure="drop_group", max_dropped=0.5, **kw):
    cfg = JudgeTable(base_url=url, model="m", **{"max_retries": 1, "timeout_seconds": 5.0, **kw})
    judge = Judge(cfg, weight=0.5, failure=failure, max_dropped_fraction=max_dropped, seed=7)
    judge.client.retry_pause_s = 0.01
    return judge


def rows(*texts):
    return [Prompt([1, 2], t, {}, f"prompts.jsonl:{i + 1}") for i, t in enumerate(texts)]


def score_from_response(user_text, n):
    return json.dumps({"score": int(re.search(r"score=(\d+)", shown(user_text, "response")).group(1))})


def test_readers_accept_json_in_prose_and_refuse_out_of_range():
    assert read_score('Sure! ```json\n{"score": 7}\n```') == 7.0
    assert read_score('{"score": 11}') is None and read_score('{"score": true}') is None
    assert read_score("7/10") is None
    assert read_scores('{"scores": [1, 2, 3]}', 3) == [1.0, 2.0, 3.0]
    assert read_scores('{"scores": [1, 2]}', 3) is None
    assert read_winner('{"winner": "B"}') == "B" and read_winner('{"winner": "C"}') is None


def test_pointwise_verdicts_cache_and_metrics(tmp_path):
    with ScriptedJudge(score_from_response) as server:
        judge = make_judge(server.base_url, cache_path=str(tmp_path / "cache.jsonl"))
        texts = ["score=8", "score=2", "score=10", "score=0"]
        j = judge.score(rows("p1", "p2"), texts, 2, update=0)
        assert j.verdicts.tolist() == [0.8, 0.2, 1.0, 0.0] and not j.failed_groups.any()
        body = server.requests[0]["body"]
        assert body["response_format"]["type"] == "json_schema" and body["temperature"] == 0.0
        assert server.requests[0]["path"] == "/v1/chat/completions"
        assert os.stat(tmp_path / "cache.jsonl").st_mode & 0o777 == 0o600
        again = make_judge(server.base_url, cache_path=str(tmp_path / "cache.jsonl")).score(rows("p1", "p2"), texts, 2, 0)
        assert len(server.requests) == 4 and again.verdicts.tolist() == j.verdicts.tolist()  # all from the cache
        m = judge_metrics(again.replies, again.verdicts, again.failed_groups, 2, again.spreads)
        assert m["judge/cache_hit_fraction"] == 1.0 and m["judge/requests"] == 4
        assert m["judge/score_mean"] == pytest.approx(0.5)


def test_listwise_maps_scores_back_through_each_order():
    def reply(user_text, n):  # scores each shown response by its own "score=k": order-independent
        k = len(re.findall(r"<R\d+>", user_text))
        return json.dumps({"scores": [int(re.search(r"score=(\d+)", shown(user_text, f"R{i}")).group(1))
                                      for i in range(1, k + 1)]})
    with ScriptedJudge(reply) as server:
        judge = make_judge(server.base_url, mode="listwise", listwise_orders=3)
        j = judge.score(rows("p"), ["score=1", "score=9", "score=5", "score=3"], 4, update=2)
        assert j.verdicts.tolist() == pytest.approx([0.1, 0.9, 0.5, 0.3])
        assert len(server.requests) == 3 and j.spreads == [0.0]
        orders = [[int(re.search(r"score=(\d)", shown(r["body"]["messages"][-1]["content"], f"R{i}")).group(1))
                   for i in range(1, 5)] for r in server.requests]
        assert len({tuple(o) for o in orders}) > 1  # the orders really differ


def test_listwise_position_bias_is_measured():
    with ScriptedJudge(lambda text, n: json.dumps({"scores": [10, 0, 0]})) as server:  # always prefers the first shown
        j = make_judge(server.base_url, mode="listwise", listwise_orders=2).score(rows("p"), ["x", "y", "z"], 3, 1)
        # the second order is the first reversed: "first shown" is a different completion each time
        firsts = [shown(r["body"]["messages"][-1]["content"], "R1") for r in server.requests]
        assert firsts[0] != firsts[1]
        lasts = [shown(r["body"]["messages"][-1]["content"], "R3") for r in server.requests]
        assert firsts[0] == lasts[1]
        assert sorted(j.verdicts.tolist()) == [0.0, 0.5, 0.5] and j.spreads == [pytest.approx(2 / 3)]


def test_pairwise_win_rates_and_position_disagreement():
    def longer_wins(user_text, n):
        a, b = shown(user_text, "A"), shown(user_text, "B")
        return json.dumps({"winner": "A" if len(a) > len(b) else "B" if len(b) > len(a) else "tie"})
    with ScriptedJudge(longer_wins) as server:
        j = make_judge(server.base_url, mode="pairwise").score(rows("p"), ["aaa", "a", "bb", "cc"], 4, update=0)
        # each plays 3 games (x2 orders): "aaa" wins all; "a" loses all; "bb" and "cc" beat "a", tie each other
        assert j.verdicts.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.5])
        assert len(server.requests) == 12 and j.spreads == [0.0]
    with ScriptedJudge(lambda text, n: '{"winner": "A"}') as server:  # pure position bias
        j = make_judge(server.base_url, mode="pairwise").score(rows("p"), ["x", "y", "z"], 3, update=0)
        assert j.verdicts.tolist() == pytest.approx([0.5, 0.5, 0.5]) and j.spreads == [1.0]
    with ScriptedJudge(lambda text, n: '{"winner": "tie"}') as server:
        j = make_judge(server.base_url, mode="pairwise", both_orders=False, max_pairs=2).score(
            rows("p"), ["x", "y", "z", "w"], 4, update=0)
        assert len(server.requests) == 2 and j.spreads == []


def test_bad_replies_are_retried_then_drop_the_group():
    with ScriptedJudge(lambda text, n: "I think it deserves a 7.") as server:
        judge = make_judge(server.base_url, max_dropped=1.0)
        j = judge.score(rows("p1", "p2"), ["a", "b", "c", "d"], 2, update=0)
        assert j.failed_groups.tolist() == [True, True] and j.verdicts.tolist() == [0.0] * 4
        assert len(server.requests) == 8  # 4 requests x (1 + 1 retry)
        m = judge_metrics(j.replies, j.verdicts, j.failed_groups, 2, j.spreads)
        assert m["judge/invalid_score_fraction"] == 1.0 and m["judge/dropped_group_fraction"] == 1.0
        with pytest.raises(JudgeError, match=r"max_judge_dropped_fraction = 0.5.*prompts.jsonl:1.*could not be read"):
            make_judge(server.base_url).score(rows("p1", "p2"), ["a", "b", "c", "d"], 2, update=0)
        with pytest.raises(JudgeError, match='judge_failure = "fail"'):
            make_judge(server.base_url, failure="fail").score(rows("p1"), ["a", "b"], 2, update=0)


def test_one_failing_group_of_two_is_dropped_and_the_other_kept():
    def reply(text, n):
        return "nonsense" if "broken" in text else '{"score": 6}'
    with ScriptedJudge(reply) as server:
        j = make_judge(server.base_url).score(rows("fine", "broken"), ["a", "b", "c", "d"], 2, update=0)
        assert j.failed_groups.tolist() == [False, True] and j.verdicts.tolist() == [0.6, 0.6, 0.0, 0.0]


def test_server_errors_are_retried_and_client_errors_are_not():
    with ScriptedJudge(lambda text, n: 503 if n == 1 else '{"score": 4}') as server:
        assert make_judge(server.base_url).score(rows("p"), ["a"], 1, 0).verdicts.tolist() == [0.4]
        assert len(server.requests) == 2
    with ScriptedJudge(lambda text, n: 401) as server:
        j = make_judge(server.base_url, max_dropped=1.0).score(rows("p"), ["a"], 1, 0)
        assert j.failed_groups.all() and len(server.requests) == 1 and "HTTP 401" in j.replies[0].error


def test_a_server_that_drips_bytes_is_cut_at_the_deadline():
    with ScriptedJudge(lambda text, n: ("drip", 30)) as server:
        judge = make_judge(server.base_url, timeout_seconds=1.0, max_retries=1, max_dropped=1.0)
        t0 = time.monotonic()
        j = judge.score(rows("p"), ["a"], 1, 0)
        assert time.monotonic() - t0 < 6 and j.failed_groups.all()
        assert "timed out after 1 s" in j.replies[0].error


def test_a_dead_server_fails_fast_with_the_reason():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    judge = make_judge(f"http://127.0.0.1:{port}/v1", max_dropped=1.0)
    t0 = time.monotonic()
    j = judge.score(rows("p"), ["a", "b"], 2, 0)
    assert time.monotonic() - t0 < 5 and j.failed_groups.all()
    assert "ConnectionRefusedError" in j.replies[0].error


def test_api_key_comes_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    with ScriptedJudge(lambda text, n: '{"score": 5}') as server:
        make_judge(server.base_url, api_key_env="MY_JUDGE_KEY").score(rows("p"), ["a"], 1, 0)
        assert server.requests[0]["headers"]["Authorization"] == "Bearer sk-test-123"
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(JudgeError, match="MY_JUDGE_KEY"):
        make_judge("http://127.0.0.1:9/v1", api_key_env="MY_JUDGE_KEY")


# ---- the rank statistics of `retrograd judge eval` ---------------------------------------------------
def test_average_ranks_share_ties():
    assert average_ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]


def test_rank_statistics_by_hand_and_by_definition():
    assert kendall_tau_b([1, 2, 3], [1, 2, 3]) == 1.0 and kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1.0
    assert spearman_rho([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    # with ties: x = [1, 2, 2, 3], y = [1, 3, 2, 4]: 5 concordant, 0 discordant, 1 tie in x -> 5 / sqrt(5 * 6)
    assert kendall_tau_b([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(5 / (30 ** 0.5))
    assert kendall_tau_b([1, 1, 1], [1, 2, 3]) is None and spearman_rho([2, 2], [1, 2]) is None
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, y = torch.randperm(7, generator=g).tolist(), torch.randperm(7, generator=g).tolist()
        n = len(x)
        d2 = sum((a - b) ** 2 for a, b in zip(x, y))  # no ties: the textbook formulas
        assert spearman_rho(x, y) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
        sign = sum((1 if (x[i] - x[j]) * (y[i] - y[j]) > 0 else -1) for i, j in itertools.combinations(range(n), 2))
        assert kendall_tau_b(x, y) == pytest.approx(sign / (n * (n - 1) / 2))
