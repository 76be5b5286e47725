"""The OpenAI-compatible server, through the official `openai` client, against a real
`kvserve serve` process on 127.0.0.1 (the `server` fixture in conftest.py)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, ServerProcess, cached_prefix_tokens

from kvserve.config import CacheConfig

GREEDY = {"temperature": 0.0}


def chat(server: ServerProcess, content: str, **kwargs):
    return server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_models_lists_the_served_model(server: ServerProcess) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny-chat"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_non_streaming_and_usage(server: ServerProcess) -> None:
    # a salt of its own: no other test's prompt can be in the cache for it
    extra = {"ignore_eos": True, "cache_salt": "usage-test"}
    r = chat(server, "Hello there", max_tokens=8, **GREEDY, extra_body=extra)
    assert r.object == "chat.completion" and r.model == "tiny-chat"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    messages = [{"role": "user", "content": "Hello there"}]
    n_prompt = server.http().post("/tokenize", json={"messages": messages}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == n_prompt + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again: every whole block of it is a hit, except that a prompt that is
    # all whole blocks recomputes its last block (the last token's logits are needed)
    again = chat(server, "Hello there", max_tokens=8, **GREEDY, extra_body=extra)
    block = CacheConfig().block_size
    want = (n_prompt // block) * block if n_prompt % block else n_prompt - block
    assert again.usage.prompt_tokens_details.cached_tokens == want > 0
    assert again.choices[0].message.content == choice.message.content


def test_chat_streaming_matches_non_streaming(server: ServerProcess) -> None:
    kwargs = dict(max_tokens=12, **GREEDY, extra_body={"ignore_eos": True})
    whole = chat(server, "Stream me a story", **kwargs)
    chunks = list(
        chat(
            server,
            "Stream me a story",
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_matches_non_streaming(server: ServerProcess) -> None:
    client = server.client()
    kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=10, **GREEDY)
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_token_ids_batch_and_n(server: ServerProcess) -> None:
    client = server.client()
    r = client.completions.create(
        model=server.model,
        prompt=[[10, 20, 30], [40, 50]],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]  # prompt i, sample j -> i*n + j
    assert r.usage.prompt_tokens == 5  # each prompt counted once, not once per sample
    assert r.usage.completion_tokens == 16


def test_seed_reproduces_and_stop_string_cuts(server: ServerProcess) -> None:
    client = server.client()
    kwargs = dict(model=server.model, prompt="The weather", max_tokens=24, temperature=0.9)
    kwargs["extra_body"] = {"ignore_eos": True}
    a = client.completions.create(seed=11, **kwargs).choices[0].text
    b = client.completions.create(seed=11, **kwargs).choices[0].text
    assert a == b and len(a) > 6
    stop = a[len(a) // 2 : len(a) // 2 + 3]
    cut = client.completions.create(seed=11, stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == a[: a.index(stop)]


def test_logprobs(server: ServerProcess) -> None:
    client = server.client()
    r = client.completions.create(
        model=server.model, prompt="Hi", max_tokens=5, logprobs=3, **GREEDY,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    c = chat(server, "Hi", max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0.0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_shared_system_prompt_is_cached_per_salt(server: ServerProcess) -> None:
    system = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(120))

    def ask(question: str, salt: str | None = None):
        extra = {"cache_salt": salt} if salt else {}
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = server.client().chat.completions.create(
            model=server.model, messages=messages, max_tokens=2, extra_body=extra
        )
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def ids(question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]

    def shared_blocks(a: str, b: str) -> int:
        """Tokens of the whole blocks b's prompt shares with a's: what the cache can serve."""
        return cached_prefix_tokens(ids(a), ids(b), CacheConfig().block_size)

    prompt, first = ask("What is one plus one?")
    assert first == 0 and prompt > 150
    _, second = ask("Name a colour.")
    assert second == shared_blocks("What is one plus one?", "Name a colour.") >= 150
    _, salted = ask("Name a colour.", salt="tenant-b")
    assert salted == 0  # another tenant sees none of it
    _, salted_again = ask("Name a fruit.", salt="tenant-b")
    assert salted_again == shared_blocks("Name a colour.", "Name a fruit.")  # its own salt


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    http = server.http()
    r = http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello, world!"


def test_metrics_move_with_traffic(server: ServerProcess) -> None:
    before = server.wait_idle()
    r = chat(server, "Count the metrics", max_tokens=6, extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == (
        r.usage.prompt_tokens
    )
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 6
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for name in ("time_to_first_token", "e2e_request_latency"):
        key = f"vllm:{name}_seconds_count"
        assert after[key] == before[key] + 1
    itl = "vllm:inter_token_latency_seconds_count"
    assert after[itl] == before[itl] + 5
    success = "vllm:request_success_total"  # summed over finish reasons
    assert after[success] == before.get(success, 0) + 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{gauge}" in after
    assert "vllm:num_preemptions_total" in after and "vllm:prefix_cache_hits_total" in after


def test_32_concurrent_streams_finish_and_free_every_block(server: ServerProcess) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, int]:
        stream = chat(
            server, f"Client {i} says hello", max_tokens=16, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [("length", 16)] * 32
    m = server.wait_idle()
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0


def _stream_body(max_tokens: int) -> dict:
    return {
        "model": "tiny-chat",
        "prompt": "A very long story begins",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def test_disconnect_mid_stream_frees_its_blocks(server: ServerProcess) -> None:
    before = server.wait_idle()
    max_tokens = MAX_MODEL_LEN - 64
    with (
        server.http() as http,
        http.stream("POST", "/v1/completions", json=_stream_body(max_tokens)) as r,
    ):
        assert r.status_code == 200
        # keep the iterator: once it is closed httpx closes the response (a disconnect)
        lines = r.iter_lines()
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data:")
        assert server.metrics()["vllm:kv_cache_usage_perc"] > 0
    after = server.wait_idle()
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < max_tokens  # aborted, not run to the end


def test_disconnect_while_waiting_for_a_non_streaming_answer(server: ServerProcess) -> None:
    before = server.wait_idle()
    body = {**_stream_body(MAX_MODEL_LEN - 64), "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        server.http(timeout=0.5).post("/v1/completions", json=body)
    after = server.wait_idle()
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < MAX_MODEL_LEN - 64
    assert "aborted" in server.log()


def test_log_has_a_line_per_request_and_a_periodic_load_line(server: ServerProcess) -> None:
    import re
    import time

    r = chat(server, "Log me", max_tokens=3, extra_body={"ignore_eos": True})
    server.wait_idle()
    time.sleep(1.5)  # the server runs with --log-interval 1
    log = server.log()
    line = next(x for x in log.splitlines() if r.id in x and "finished" in x)
    assert re.search(
        rf"finished \(length\): prompt {r.usage.prompt_tokens} tokens \(\d+ cached\), "
        r"generated 3; queue \d+ ms, TTFT \d+ ms, decode \d+ ms",
        line,
    ), line
    assert re.search(
        r"running \d+, waiting \d+, KV cache usage [\d.]+% \(\d+/\d+ blocks\), prefix cache hit "
        r"rate [\d.]+%",
        log,
    )
