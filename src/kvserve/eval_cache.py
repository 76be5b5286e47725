"""What a lossy KV cache costs: each cache variant against the exact cache, on the same text.

Teacher-forced: the text runs through the model in prefill chunks of ``chunk`` tokens over the
engine's own paged attention (``PagedAttention`` over a ``KVCacheStorage`` of the variant's
spec), once with the exact cache and once per variant, in lockstep. Every query reads K/V back
from the cache (its own chunk's too), as llama.cpp does, so a variant's loss shows at every
position, not only past the first chunk. Per variant:

    perplexity        exp(mean NLL of each next token), and its change against the exact cache
    mean / p99 KL     KL(exact || variant) of the next-token distributions, per position
    top-1 agreement   share of positions whose argmax is the exact cache's
    max |dlogit|      largest logit difference anywhere
    bytes per token   the spec's, exactly; tokens that fit in 1 GiB
    kept              the StreamingLLM rows (``window_variants``): the tokens each query still
                      sees (sinks + window), whatever the text's length

Free-running: greedy generation from a few prompts (prefill, then one decode step at a time,
through the engine's decode path, so the quantized decode kernel is what runs); the first
generated position where the variant's token differs from the exact cache's (None: none did).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from kvserve.attention.paged import AttentionMetadata, PagedAttention
from kvserve.config import GIB
from kvserve.intmath import cdiv
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.llama import LlamaForCausalLM

# (label, K, V); "auto" is the model's dtype. The table of issue 10: the keys-vs-values claim
# reads off the last two rows.
DEFAULT_VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("exact", "auto", "auto"),
    ("int8", "int8", "int8"),
    ("int4", "int4", "int4"),
    ("int4_sym", "int4_sym", "int4_sym"),
    ("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
    ("K int4 + V int8", "int4", "int8"),
    ("K int8 + V int4", "int8", "int4"),
)
DEFAULT_PROMPTS = (
    "The old lighthouse keeper climbed the stairs every evening because",
    "Here is a simple recipe for bread:",
    "Write a short letter to a friend about your week.",
    "The three most important things to know about bicycles are",
)


def default_text() -> str:
    """The English prose shipped with the package (written for it; public domain)."""
    return resources.files("kvserve.data").joinpath("eval_prose.txt").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class CacheVariant:
    label: str
    k_dtype: str  # a CACHE_DTYPE_NAMES name; "auto" = the model's dtype
    v_dtype: str
    streaming: tuple[int, int] | None = None  # (sinks, window): the StreamingLLM policy

    def spec(self, model: LlamaForCausalLM, block_size: int) -> KVCacheSpec:
        return model.kv_cache_spec(
            CacheDtype.parse(self.k_dtype, model.dtype),
            CacheDtype.parse(self.v_dtype, model.dtype),
            block_size,
            self.streaming,
        )


def window_variants(windows: Sequence[int], sinks: int) -> list[CacheVariant]:
    """Per window size W: the window alone, and ``sinks`` sinks + a window of W - sinks (the
    same number of cached tokens), both in the model's dtype."""
    out = []
    for w in windows:
        if w <= sinks:
            raise ValueError(f"a window of {w} tokens leaves no room beside {sinks} sinks")
        out.append(CacheVariant(f"window {w}", "auto", "auto", (0, w)))
        out.append(
            CacheVariant(f"{sinks} sinks + window {w - sinks}", "auto", "auto", (sinks, w - sinks))
        )
    return out


@dataclass(frozen=True, slots=True)
class EvalRow:
    variant: str
    k_dtype: str
    v_dtype: str
    bytes_per_token: int
    tokens_per_gib: int
    perplexity: float
    perplexity_delta_pct: float  # against the exact cache's perplexity
    mean_kl: float
    p99_kl: float
    top1_agreement: float
    max_abs_logit_diff: float
    first_divergence: tuple[int | None, ...]  # per prompt: first differing generated position
    kept_tokens: int | None = None  # sinks + window under the streaming policy; None: all

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class EvalReport:
    text_tokens: int
    generated_tokens: int  # per prompt
    chunk: int
    rows: tuple[EvalRow, ...]


class _Sequence:
    """One request's cache under one spec: its blocks are 0 .. n - 1 of its own storage."""

    def __init__(self, model: LlamaForCausalLM, spec: KVCacheSpec, max_tokens: int) -> None:
        self.model = model
        self.block_size = spec.block_size
        nb = cdiv(max_tokens, spec.block_size)
        # every group its own tensors, so every group's table can be 0 .. nb - 1 (windows are
        # applied by the attention's masks; nothing is given back here)
        self.storage = KVCacheStorage(spec, nb, model.device, model.dtype, share_tensors=False)
        self.table = torch.arange(nb, device=model.device)[None]  # (1, nb)
        self.num_groups = len(spec.groups)
        self.rotary = model.model.rotary_emb if spec.has_sinks else None
        self.length = 0

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ids (t,) at positions length .. length + t - 1; float32 logits (t, vocab)."""
        t = ids.numel()
        positions = torch.arange(self.length, self.length + t, device=ids.device)
        total = self.length + t
        md = AttentionMetadata(
            slot_mapping=positions,  # block i holds positions [i * bs, (i + 1) * bs)
            query_start_loc=[0, t],
            seq_lens=[total],
            block_tables=self.table,
            num_decodes=1 if t == 1 else 0,
            seq_lens_tensor=torch.tensor([total], device=ids.device),
            group_slot_mappings=[positions] * self.num_groups,
            group_block_tables=[self.table] * self.num_groups,
        )
        attn = PagedAttention(
            self.storage, md, self.model.config.attention_scale, rotary=self.rotary
        )
        hidden = self.model(ids, positions, attn)
        self.length = total
        return self.model.compute_logits(hidden)


@dataclass(slots=True)
class _Stats:
    nll: float = 0.0
    kl: list[torch.Tensor] | None = None
    agree: int = 0
    max_diff: float = 0.0


def evaluate(
    model: LlamaForCausalLM,
    text_ids: Sequence[int],
    variants: Sequence[CacheVariant] | None = None,
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 64,
    chunk: int = 256,
    block_size: int = 16,
) -> EvalReport:
    """The table of this module's docstring for ``variants`` (default: DEFAULT_VARIANTS)."""
    if len(text_ids) < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {len(text_ids)}")
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    if len(text_ids) > model.config.max_model_len:
        raise ValueError(
            f"the text has {len(text_ids)} tokens, more than the model's context of "
            f"{model.config.max_model_len}"
        )
    variants = list(variants or [CacheVariant(*v) for v in DEFAULT_VARIANTS])
    exact = CacheVariant("exact", "auto", "auto")
    ids = torch.tensor(list(text_ids), device=model.device)
    n = ids.numel()
    seqs = [_Sequence(model, v.spec(model, block_size), n) for v in [exact, *variants]]
    stats = [_Stats(kl=[]) for _ in variants]
    exact_nll = 0.0
    for lo in range(0, n - 1, chunk):
        hi = min(n - 1, lo + chunk)  # positions lo .. hi - 1 predict tokens lo + 1 .. hi
        targets = ids[lo + 1 : hi + 1]
        ref = seqs[0].extend(ids[lo:hi])
        ref_lp = torch.log_softmax(ref, -1)
        exact_nll += float(-ref_lp.gather(1, targets[:, None]).sum())
        ref_top = ref.argmax(-1)
        for s, seq in zip(stats, seqs[1:], strict=True):
            got = seq.extend(ids[lo:hi])
            lp = torch.log_softmax(got, -1)
            s.nll += float(-lp.gather(1, targets[:, None]).sum())
            s.kl.append((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0))
            s.agree += int((got.argmax(-1) == ref_top).sum())
            s.max_diff = max(s.max_diff, float((got - ref).abs().max()))
    positions = n - 1
    ppl_exact = math.exp(exact_nll / positions)
    exact_runs = [_greedy(model, exact.spec(model, block_size), p, max_new_tokens) for p in prompts]
    nones = (None,) * len(prompts)
    rows = [_row(exact, seqs[0].storage.spec, ppl_exact, ppl_exact, None, positions, nones)]
    for v, s, seq in zip(variants, stats, seqs[1:], strict=True):
        runs = [_greedy(model, seq.storage.spec, p, max_new_tokens) for p in prompts]
        firsts = tuple(_first_difference(a, b) for a, b in zip(exact_runs, runs, strict=True))
        ppl = math.exp(s.nll / positions)
        rows.append(_row(v, seq.storage.spec, ppl, ppl_exact, s, positions, firsts))
    return EvalReport(n, max_new_tokens, chunk, tuple(rows))


def _row(v, spec, ppl, ppl_exact, s: _Stats | None, positions: int, firsts) -> EvalRow:
    kl = torch.cat(s.kl) if s is not None else torch.zeros(1)
    return EvalRow(
        variant=v.label,
        k_dtype=spec.layers[0].k_dtype.name,
        v_dtype=spec.layers[0].v_dtype.name,
        bytes_per_token=spec.bytes_per_token,
        tokens_per_gib=GIB // spec.bytes_per_token,
        perplexity=ppl,
        perplexity_delta_pct=100.0 * (ppl / ppl_exact - 1.0),
        mean_kl=float(kl.mean()),
        p99_kl=float(torch.quantile(kl.double(), 0.99)),
        top1_agreement=(s.agree / positions) if s is not None else 1.0,
        max_abs_logit_diff=s.max_diff if s is not None else 0.0,
        first_divergence=firsts,
        kept_tokens=None if v.streaming is None else sum(v.streaming),
    )


def _greedy(model, spec: KVCacheSpec, prompt: Sequence[int], n: int) -> list[int]:
    seq = _Sequence(model, spec, len(prompt) + n)
    logits = seq.extend(torch.tensor(list(prompt), device=model.device))[-1]
    out = []
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        logits = seq.extend(torch.tensor([token], device=model.device))[-1]
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def table(report: EvalReport) -> list[str]:
    """The report as a Markdown table, one row per variant."""
    lines = [
        f"teacher-forced over {report.text_tokens:,} tokens (chunks of {report.chunk}); greedy "
        f"{report.generated_tokens} tokens per prompt",
        "",
        "| cache | bytes/token | tokens per GiB | kept | perplexity | Δ ppl | mean KL | p99 KL "
        "| top-1 agree | max abs Δlogit | first greedy divergence |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        firsts = ", ".join("-" if f is None else str(f) for f in r.first_divergence) or "-"
        lines.append(
            f"| {r.variant} | {r.bytes_per_token:,} | {r.tokens_per_gib:,} "
            f"| {'all' if r.kept_tokens is None else f'{r.kept_tokens:,}'} | {r.perplexity:.4f} "
            f"| {r.perplexity_delta_pct:+.3f}% | {r.mean_kl:.5f} | {r.p99_kl:.5f} "
            f"| {r.top1_agreement:.2%} | {r.max_abs_logit_diff:.3f} | {firsts} |"
        )
    return lines
