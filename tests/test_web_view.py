"""The web view in a real browser: headless Chromium (Debian's ``chromium``) driven by
Playwright against a real ``kvserve serve`` process on a tiny chat checkpoint.

The page asks for the API key on the first 401; the calculator, moved by its sliders, shows the
lessons' example (32 layers, 8 KV heads, head dim 128, fp16, 8192 tokens = 1,073,741,824 bytes
per request); a chat turn shows its blocks in use while it runs and exactly the prefix cache's
blocks afterwards; the next turn reports prompt tokens served from the cache. Screenshots are
left in ``$KVSERVE_TEST_ARTIFACTS`` (default tests/artifacts/): web_view_running.png during the
first turn, web_view.png after the second.

Chromium and Playwright's Python package are test requirements (CI installs both:
scripts/setup.sh, the ``test`` extra): without them these tests fail, they never skip, and
nothing is downloaded (no ``playwright install``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from server_helpers import ServerProcess, build_chat_checkpoint, start_server

CHROMIUM = Path(os.environ.get("KVSERVE_CHROMIUM", "/usr/bin/chromium"))
KEY = "web-view-key"
BLOCK = 16  # the server's default block size
MAX_MODEL_LEN = 8192  # room for a long answer and the turn after it
# long enough for the page's polls (every 100 ms while its turn runs) to see it run on a fast
# machine (~1 ms a step), short enough on a slow one (~25-60 ms)
ANSWER_TOKENS = 600
TURN_TIMEOUT_MS = 120_000
ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    checkpoint = build_chat_checkpoint(tmp_path_factory.mktemp("web"), MAX_MODEL_LEN)
    proc = start_server(
        checkpoint, tmp_path_factory.mktemp("web-logs"), "--enforce-eager",
        "--num-kv-blocks", "512", api_key=KEY,
    )  # fmt: skip
    yield proc
    proc.stop()


@contextmanager
def open_page(server: ServerProcess):
    """The page at /, keyed in (after a wrong key), in a fresh headless Chromium; fails (never skips) if either
    Chromium or Playwright is missing. Checks on the way out that no script raised and that
    every request went to this server."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail(
            "Playwright for Python is missing: pip install -e '.[test]' installs it (the "
            "package only: the test drives the system chromium, never `playwright install`)"
        )
    if not CHROMIUM.exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: apt-get install -y chromium (scripts/setup.sh does), "
            "or point KVSERVE_CHROMIUM at one"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.set_default_timeout(30_000)
            errors: list[str] = []
            urls: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: urls.append(r.url))
            page.goto(f"{server.url}/")
            # the page loads without a key, then asks for one: kv_state answered 401
            expect(page.locator("#key-form")).to_be_visible()
            expect(page.locator("#status")).to_have_text("this server needs an API key")
            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            expect(page.locator("#status")).to_have_text("that API key was refused: enter another")
            expect(page.locator("#key-form")).to_be_visible()
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            expect(page.locator("#model-name")).to_have_text("tiny-chat")
            expect(page.locator("#key-form")).to_be_hidden()
            yield page, expect
            assert errors == [], errors
            assert all(u.startswith(server.url) for u in urls), urls
        finally:
            browser.close()


def test_the_calculator_shows_the_lessons_example(served: ServerProcess) -> None:
    with open_page(served) as (page, expect):
        # prefilled from the served model: 2 layers, 4 KV heads of 16, its context
        expect(page.locator("#calc-layers-n")).to_have_value("2")
        expect(page.locator("#calc-kv-heads-n")).to_have_value("4")
        expect(page.locator("#calc-head-dim-n")).to_have_text("16")
        expect(page.locator("#calc-context-n")).to_have_value(str(MAX_MODEL_LEN))
        dtype = page.locator("#calc-k-dtype").input_value()  # "auto": the model's dtype
        per_token = 2 * 4 * 2 * 16 * {"float32": 4, "bfloat16": 2}[dtype]
        expect(page.locator("#calc-per-token")).to_contain_text(f"{per_token:,} B")

        # what a text costs: tokenized by the server, priced at the served cache layout
        page.fill("#cost-text", "Specialist language shatters into more pieces.")
        page.click("#cost-go")
        out = page.locator("#cost-out")
        expect(out).to_contain_text("tokens per word")
        tokens = int(out.get_attribute("data-tokens"))
        assert tokens > 0
        expect(out).to_contain_text(f"{tokens} tokens, 6 words")
        expect(out).to_contain_text(f"it holds {tokens * per_token:,} B (")

        # the lessons' example, set with the sliders: 31 layers, then one step right
        page.locator("#calc-layers").fill("31")
        expect(page.locator("#calc-layers-n")).to_have_value("31")
        page.locator("#calc-layers").press("ArrowRight")
        expect(page.locator("#calc-layers-n")).to_have_value("32")
        page.locator("#calc-kv-heads").fill("8")
        head_dim = page.locator("#calc-head-dim")
        for _ in range(20):  # the head-dim slider steps through the dims the server priced
            if page.locator("#calc-head-dim-n").text_content() == "128":
                break
            head_dim.press("ArrowRight")
        expect(page.locator("#calc-head-dim-n")).to_have_text("128")
        page.select_option("#calc-k-dtype", "float16")
        page.select_option("#calc-v-dtype", "float16")
        page.locator("#calc-context").fill("8192")
        page.locator("#calc-users").fill("4")
        page.locator("#calc-memory").fill("80")
        expect(page.locator("#calc-per-token")).to_have_text(
            "131,072 B (131.07 kB, 128.00 KiB) = 32 × 8 × (256 + 256)"
        )
        expect(page.locator("#calc-per-request")).to_have_text(
            "1,073,741,824 B (1.07 GB, 1.00 GiB)"
        )
        expect(page.locator("#calc-total")).to_have_text("4,294,967,296 B (4.29 GB, 4.00 GiB)")
        expect(page.locator("#calc-fit")).to_contain_text("80 in 80 GiB")

        # a lossy cache from the server's own byte counts: int8 is 34 bytes per 32 values
        page.select_option("#calc-k-dtype", "int8")
        page.select_option("#calc-v-dtype", "int8")
        expect(page.locator("#calc-per-token")).to_contain_text(
            f"{32 * 8 * 2 * 136:,} B"
        )  # 128 codes + 4 float16 scales per head, K and V
        expect(page.locator("#calc-per-request")).to_contain_text(f"{32 * 8 * 2 * 136 * 8192:,} B")


def chat_turn(page, text: str, max_tokens: int) -> dict:
    """Send one turn from the chat box; the response body the page got."""
    page.fill("#chat-input", text)
    page.fill("#chat-max-tokens", str(max_tokens))
    with page.expect_response(
        lambda r: r.url.endswith("/v1/chat/completions"), timeout=TURN_TIMEOUT_MS
    ) as response:
        page.click("#chat-send")
    return response.value.json()


def test_a_chat_turn_shows_in_the_pool_and_the_next_one_hits_the_cache(
    served: ServerProcess,
) -> None:
    with open_page(served) as (page, expect):
        expect(page.locator("#pool-free")).to_have_text("512")
        expect(page.locator("#pool-used")).to_have_text("0")
        page.check("#chat-ignore-eos")
        page.fill("#chat-input", "Tell me about the KV cache.")
        page.fill("#chat-max-tokens", str(ANSWER_TOKENS))
        with page.expect_response(
            lambda r: r.url.endswith("/v1/chat/completions"), timeout=TURN_TIMEOUT_MS
        ) as turn:
            page.click("#chat-send")
            # while the answer is generated the page shows its blocks, coloured by request
            expect(page.locator("#pool-used")).not_to_have_text(re.compile(r"^(0|–)$"))
            holder = page.locator("#pool-requests li").first.text_content()
            assert holder.startswith("chatcmpl-"), holder
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "web_view_running.png"), full_page=True)
        usage = turn.value.json()["usage"]
        prompt = usage["prompt_tokens"]
        assert usage["completion_tokens"] == ANSWER_TOKENS
        # afterwards: nothing in use, and every full block of the turn cached (its last token
        # is never computed: prompt + ANSWER_TOKENS - 1 tokens have K/V)
        cached_blocks = (prompt + ANSWER_TOKENS - 1) // BLOCK
        expect(page.locator("#pool-used")).to_have_text("0")
        expect(page.locator("#pool-cached")).to_have_text(str(cached_blocks))
        expect(page.locator("#pool-free")).to_have_text(str(512 - cached_blocks))
        first = page.locator(".turn.assistant .usage").nth(0)
        expect(first).to_have_attribute("data-cached-tokens", "0")
        expect(first).to_have_attribute("data-computed-tokens", str(prompt))
        expect(page.locator("#stat-ttft")).to_contain_text("(last 1 request)")

        second = chat_turn(page, "And what does it cost?", 8)["usage"]
        cached = second["prompt_tokens_details"]["cached_tokens"]
        # the first turn's prompt is a prefix of the second's: its full blocks, at least
        assert cached >= (prompt // BLOCK) * BLOCK > 0 and cached % BLOCK == 0, second
        shown = page.locator(".turn.assistant .usage").nth(1)
        expect(shown).to_have_attribute("data-cached-tokens", str(cached))
        expect(shown).to_have_attribute(
            "data-computed-tokens", str(second["prompt_tokens"] - cached)
        )
        expect(shown).to_contain_text(f"{cached:,} from the cache")
        expect(page.locator("#pool-used")).to_have_text("0")
        page.screenshot(path=str(ARTIFACTS / "web_view.png"), full_page=True)
