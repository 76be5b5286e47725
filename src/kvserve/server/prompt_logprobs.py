"""The prompt's logprobs in the two shapes clients read them.

- vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
  ``{token_id (str): {"logprob", "rank", "decoded_token"}}`` with the position's top k and
  the prompt's own token.
- OpenAI's legacy ``echo`` + ``logprobs``: the prompt tokens lead ``choices[i].logprobs``
  (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), the first one's
  ``token_logprob`` and ``top_logprobs`` null, as OpenAI and vLLM return them. This is what
  lm-evaluation-harness's ``local-completions`` sums for a loglikelihood.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.request import RequestOutput
from kvserve.server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs
from kvserve.server.serving import Served


def vllm_prompt_logprobs(served: Served, out: RequestOutput, k: int) -> PromptLogprobs:
    """vLLM's shape, with the top k of each position (and the prompt's token)."""
    assert out.prompt_logprobs is not None and out.prompt_token_ranks is not None
    result: PromptLogprobs = []
    for token, entry, rank in zip(
        out.prompt_token_ids, out.prompt_logprobs, out.prompt_token_ranks, strict=True
    ):
        if entry is None:
            result.append(None)
            continue
        # the top k come best first (rank i + 1); the prompt token has its own rank
        result.append(
            {
                str(t): PromptLogprob(
                    logprob=v,
                    rank=rank if t == token else i + 1,
                    decoded_token=served.token_text(t),
                )
                for i, (t, v) in enumerate(top(entry, k, token).items())
            }
        )
    return result


def top(entry: dict[int, float], k: int, token: int) -> dict[int, float]:
    """The k most likely of an entry (which may hold more: the engine computed the larger
    of ``logprobs`` and ``prompt_logprobs``), then ``token`` if it is not among them."""
    # the entry's top K (>= k) come first, best first; the token, if not among them, last
    kept = dict(list(entry.items())[:k])
    kept.setdefault(token, entry[token])
    return kept


def echo_logprobs(
    served: Served,
    prompt_ids: Sequence[int],
    entries: Sequence[dict[int, float] | None],
    k: int,
) -> tuple[CompletionLogprobs, int]:
    """The prompt's part of an echoed ``logprobs``: one row per prompt token, the first
    null; and the text offset after them (where the completion's rows continue)."""
    lp = CompletionLogprobs()
    offset = 0
    for token, entry in zip(prompt_ids, entries, strict=True):
        text = served.token_text(token)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(entry[token])
        lp.top_logprobs.append({served.token_text(t): v for t, v in top(entry, k, token).items()})
    return lp, offset
