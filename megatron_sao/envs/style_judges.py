"""Judges for the style-shift task: did a text follow a given style? (binary)

``RuleBasedStyleJudge`` is deterministic and dependency-free (default, tests, CPU demo).
Rule: count the *distinct* markers of each style found in the text (case-insensitive, whole
words/phrases; symbol markers such as ``~`` or ``<3`` as substrings). The text adheres to style
S iff it has at least ``min_hits`` distinct markers of S and strictly more than of any other
style; so a text that sprinkles markers of every style is not rewarded for all of them.

``OpenAICompatibleJudge`` asks an OpenAI-compatible chat endpoint (vLLM, SGLang, ...) a YES/NO
question, with the standard library only (urllib) so that the project gains no dependency.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request
from typing import Protocol

STYLES = ("academic", "cute", "chuunibyou", "classical")

STYLE_DESCRIPTIONS = {
    "academic": "formal academic prose: hedged claims, evidence, transitions such as 'furthermore'",
    "cute": "cute and playful: 'hehe', 'yay', '~', hearts, fluffy and sparkly things",
    "chuunibyou": "chuunibyou: grandiose dark-fantasy self-mythology, sealed powers, destiny, the abyss",
    "classical": "classical / archaic English: thee, thou, hath, doth, 'tis, alas",
}

STYLE_MARKERS: dict[str, tuple[str, ...]] = {
    "academic": ("furthermore", "moreover", "in conclusion", "consequently", "therefore", "evidence",
                 "analysis", "hypothesis", "this essay", "et al", "empirical", "notably"),
    "cute": ("hehe", "teehee", "yay", "uwu", "nya", "kawaii", "fluffy", "sparkly", "bunny", "~",
             "<3", "\u2661", "^_^"),
    "chuunibyou": ("dark flame", "sealed", "right eye", "destiny", "forbidden", "awaken", "mortals",
                   "abyss", "cursed", "ancient power", "my true power", "dragon"),
    "classical": ("thee", "thou", "thy", "hath", "doth", "'tis", "wherefore", "alas", "verily",
                  "o'er", "ere", "henceforth"),
}


class StyleJudge(Protocol):
    async def judge(self, prompt: str, response: str, style: str) -> bool: ...


class JudgeError(RuntimeError):
    """The judge could not give a verdict (unreachable endpoint, malformed reply)."""


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known styles: {list(STYLES)}")


def _marker_pattern(marker: str) -> re.Pattern:
    if re.fullmatch(r"[\w' ]+", marker):  # words / phrases: match on word boundaries
        return re.compile(r"(?<![\w'])" + re.escape(marker) + r"(?![\w'])", re.IGNORECASE)
    return re.compile(re.escape(marker))


_PATTERNS = {s: [(m, _marker_pattern(m)) for m in ms] for s, ms in STYLE_MARKERS.items()}


def style_marker_counts(text: str) -> dict[str, int]:
    """Number of distinct markers of each style present in ``text``."""
    return {s: sum(1 for _, pat in pats if pat.search(text)) for s, pats in _PATTERNS.items()}


class RuleBasedStyleJudge:
    """Deterministic marker-count judge (see the module docstring for the rule)."""

    def __init__(self, min_hits: int = 2) -> None:
        if min_hits < 1:
            raise ValueError(f"min_hits must be >= 1, got {min_hits}")
        self.min_hits = min_hits

    def adheres(self, response: str, style: str) -> bool:
        _check_style(style)
        counts = style_marker_counts(response)
        best_other = max(c for s, c in counts.items() if s != style)
        return counts[style] >= self.min_hits and counts[style] > best_other

    async def judge(self, prompt: str, response: str, style: str) -> bool:
        return self.adheres(response, style)


JUDGE_TEMPLATE = (
    "You are a strict style judge. The target style is: {style} ({description}).\n\n"
    "Writing prompt:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Is the response clearly written in the target style? Answer with exactly one word: YES or NO."
)


class OpenAICompatibleJudge:
    """LLM judge over ``POST {base_url}/chat/completions``; the verdict is the first word YES/NO."""

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 30.0, max_response_chars: int = 4000) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_response_chars = max_response_chars

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise JudgeError(f"judge API key: environment variable {self.api_key_env} is not set "
                                 "(pass api_key_env=None for an endpoint without authentication)")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, prompt: str, response: str, style: str) -> bool:
        content = JUDGE_TEMPLATE.format(style=style, description=STYLE_DESCRIPTIONS[style], prompt=prompt,
                                        response=response[: self.max_response_chars])
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "temperature": 0.0, "max_tokens": 4}).encode()
        req = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                reply = json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            raise JudgeError(f"judge endpoint {self.url} answered HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise JudgeError(f"judge endpoint {self.url} unreachable or too slow "
                             f"(timeout {self.timeout_s:g} s): {e}") from None
        except json.JSONDecodeError:
            raise JudgeError(f"judge endpoint {self.url} did not return JSON") from None
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"judge reply has no choices[0].message.content: {str(reply)[:300]}") from None
        word = re.sub(r"[^A-Za-z]", "", (text or "").strip().split(maxsplit=1)[0] if (text or "").strip() else "")
        if word.upper() not in ("YES", "NO"):
            raise JudgeError(f"judge answered {text!r}, expected YES or NO")
        return word.upper() == "YES"

    async def judge(self, prompt: str, response: str, style: str) -> bool:
        _check_style(style)
        return await asyncio.to_thread(self._request, prompt, response, style)
