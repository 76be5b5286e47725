"""README's lm-eval recipe for a server started with --api-key works as written: lm-eval's
``local-completions`` with the remote tokenizer, built from the recipe's own --model_args
(``auth_token``) and OPENAI_API_KEY, scores a continuation; without ``auth_token`` its remote
tokenizer stops at /tokenizer_info with a 401 (what users hit). In-process lm-eval against the
shared key-protected server (conftest's ``server``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
RECIPE = re.compile(
    r"OPENAI_API_KEY=KEY lm_eval --model local-completions --tasks TASK \\\n"
    r"  --model_args (\S+)\n"
)


def recipe_model_args(url: str, model: str, key: str) -> str:
    (args,) = RECIPE.findall(README.read_text())
    base = "http://127.0.0.1:8000"
    assert base in args and "auth_token=KEY" in args, args
    return args.replace("NAME", model).replace(base, url).replace("KEY", key)


def test_the_readme_recipe_runs_against_a_server_with_a_key(
    server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    args = recipe_model_args(server.url, server.model, server.api_key)
    lm = get_model("local-completions").create_from_arg_string(args + ",max_retries=1")
    http = server.http()

    def tokens(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return http.post("/tokenize", json=body).json()["tokens"]

    # the remote tokenizer went through /tokenizer_info and /tokenize with the key
    assert lm.tok_encode("The sky is blue") == tokens("The sky is blue")
    request = Instance("loglikelihood", doc={}, arguments=("The sky is", " blue"), idx=0)
    ((loglik, _),) = lm.loglikelihood([request])
    # the same score straight from the server: the continuation's echoed logprobs
    ids, n_context = tokens("The sky is blue"), len(tokens("The sky is"))
    body = {"model": server.model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}
    rows = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert loglik == pytest.approx(sum(rows["token_logprobs"][n_context : len(ids)]), abs=1e-4)


def test_without_auth_token_the_remote_tokenizer_gets_a_401(
    server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    args = recipe_model_args(server.url, server.model, server.api_key)
    without = ",".join(a for a in args.split(",") if not a.startswith("auth_token="))
    with pytest.raises(RuntimeError, match=r"/tokenizer_info failed .*401"):
        get_model("local-completions").create_from_arg_string(without)
