"""lm-evaluation-harness runs against a real `kvserve serve` unchanged: ``lm_eval --model
local-completions`` (token-id prompts, ``echo: true, logprobs: 1, max_tokens: 1``, the
remote tokenizer over /tokenizer_info, /tokenize and /detokenize) on two local tasks, a
loglikelihood one and a multiple-choice one (task YAMLs over jsonl files; nothing is
downloaded). The loglikelihoods, greedy flags, perplexity and accuracies lm-eval reports
must equal a full no-cache float32 forward of the same checkpoint
(``kvserve.reference.decoders.full_logits``) over the same tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_helpers import start_server

from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import full_logits

pytest.importorskip("lm_eval")

TASK = "kvserve_local_loglikelihood"
MC_TASK = "kvserve_local_multiple_choice"
MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["three", "four"], "answer": 1},
    {"question": "Cats like to", "choices": ["sleep", "fly", "swim", "code"], "answer": 0},
]
DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three,", "continuation": " four, five"},
    {"context": "Water boils at one hundred degrees", "continuation": " Celsius at sea level."},
    {"context": "def add(a, b):\n   ", "continuation": " return a + b"},
    {"context": "Hello", "continuation": " world"},
]


def greedy_doc(session: ModelSession) -> dict[str, str]:
    """A doc whose continuation is the model's own greedy text (a random model's tokens
    rarely are), so lm-eval's greedy flag and accuracy are checked true as well as false."""
    tok = session.tokenizer
    assert tok is not None
    for context in ("Once upon a time", "I think", "The answer is", "Yes"):
        ids = tok.encode(context, add_special_tokens=False)
        for _ in range(2):
            ids.append(int(full_logits(session.model, ids)[-1].argmax()))
        continuation = tok.decode(ids[-2:])
        if tok.encode(context + continuation, add_special_tokens=False) == ids and not (
            continuation.startswith(" ") and context.endswith(" ")
        ):
            return {"context": context, "continuation": continuation}
    pytest.fail("no greedy continuation that re-tokenizes to itself")


def write_task(directory: Path, docs: list[dict[str, str]]) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    mc_data = directory / "mc.jsonl"
    mc_data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (directory / f"{MC_TASK}.yaml").write_text(
        f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc_data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )


def reference_loglikelihood(session: ModelSession, context: str, continuation: str):
    """What lm-eval computes, from our own forward: it moves the context's trailing spaces to
    the continuation, encodes context + continuation without special tokens, and scores the
    continuation's tokens; greedy = every one is its position's argmax."""
    tok = session.tokenizer
    assert tok is not None
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctxlen = len(tok.encode(context, add_special_tokens=False))
    logp = torch.log_softmax(full_logits(session.model, whole), dim=-1)  # (P, vocab)
    targets = whole[ctxlen:]
    rows = logp[ctxlen - 1 : len(whole) - 1]  # position j - 1 predicts token j
    loglik = rows.gather(1, torch.tensor(targets)[:, None]).sum().item()
    greedy = rows.argmax(dim=-1).tolist() == targets
    return loglik, greedy


@pytest.fixture(scope="module")
def f32_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = start_server(
        chat_checkpoint, tmp_path_factory.mktemp("logs"), "--dtype", "float32", "--enforce-eager"
    )
    yield proc
    proc.stop()


def test_lm_eval_local_completions_tasks(f32_server, chat_checkpoint, tmp_path) -> None:
    session = ModelSession.open(chat_checkpoint, "float32", "cpu")
    docs = [*DOCS, greedy_doc(session)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_task(tasks, docs)
    out = tmp_path / "out"
    model_args = ",".join(
        [
            f"model={f32_server.model}",
            f"base_url={f32_server.url}/v1/completions",
            "tokenizer_backend=remote",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    argv = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
    argv += [
        "--model_args",
        model_args,
        "--tasks",
        f"{TASK},{MC_TASK}",
        "--include_path",
        str(tasks),
    ]
    argv += ["--batch_size", "2", "--log_samples", "--output_path", str(out)]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    (samples_file,) = out.rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    logliks, greedies = [], []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = docs[s["doc_id"]]
        expected, greedy = reference_loglikelihood(session, doc["context"], doc["continuation"])
        got, got_greedy = s["resps"][0][0]  # as lm-eval logs them: strings
        assert float(got) == pytest.approx(expected, abs=1e-3), doc
        assert got_greedy == str(greedy), doc
        logliks.append(expected)
        greedies.append(greedy)
    assert greedies[-1] is True and greedies.count(True) < len(greedies)

    # multiple choice: one loglikelihood per choice, the continuation " " + choice
    (mc_file,) = out.rglob(f"samples_{MC_TASK}_*.jsonl")
    mc_samples = [json.loads(line) for line in mc_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in mc_samples) == list(range(len(MC_DOCS)))
    correct = []
    for s in mc_samples:
        doc = MC_DOCS[s["doc_id"]]
        expected = [
            reference_loglikelihood(session, doc["question"], " " + c)[0] for c in doc["choices"]
        ]
        got = [float(r[0][0]) for r in s["resps"]]
        assert got == pytest.approx(expected, abs=1e-3), doc
        correct.append(max(range(len(expected)), key=expected.__getitem__) == doc["answer"])

    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    metrics = results[TASK]
    assert metrics["perplexity,none"] == pytest.approx(
        math.exp(-sum(logliks) / len(logliks)), rel=1e-3
    )
    assert metrics["acc,none"] == pytest.approx(sum(greedies) / len(greedies))
    assert results[MC_TASK]["acc,none"] == pytest.approx(sum(correct) / len(correct))
