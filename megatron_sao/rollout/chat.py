"""Token-level chat handling for multi-turn rollouts, free of re-tokenization drift.

A multi-turn trajectory is built by *appending ids*: the prompt ids once, then
for every turn the ids the policy sampled exactly as sampled (stop token included) and the ids of the
environment's reply. The policy's ids are never decoded and encoded again; decoding only produces
the action *text* handed to the environment. Re-rendering the whole conversation each turn would
re-tokenize the model's output (a different split of the same text, a dropped stop token, a template
that rewrites earlier turns such as Qwen3 stripping ``<think>`` blocks), and the ids, log-probs and
masks would silently stop lining up.

The observation ids come from the model's own chat template by a render diff, the trick verl, slime
and AReaL use: render a fixed probe conversation ``[user, assistant(MARK), new_message]`` with the
generation prompt, find the end of ``MARK`` and keep what follows. That suffix is

    <closing of the assistant turn> <role markers + observation text> <next generation prompt>

(Qwen3: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n12\\n</tool_response><|im_end|>\\n
<|im_start|>assistant\\n``; the char template: ``<|end|><|tool|>12<|end|><|assistant|>``). The
closing (``<|im_end|>\\n``) is measured once at construction; the policy usually sampled its first
token (the stop token), so only the part it did not sample is added. Cutting at the end of ``MARK``
rather than diffing two whole renders matters for Qwen3: its template renders the last assistant
message differently (an empty think block) from an earlier one, so ``render([.., a])`` is not a
prefix of ``render([.., a, tool])``, while the text after the assistant content is the same.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_sao.errors import UserError

# Content of the probe assistant message. It must survive the template unchanged and never occur in
# the probe user message, so its position marks where the assistant's content ends.
_MARK = "SAO_PROBE_ASSISTANT_CONTENT_7f3a"
_PROBE_USER = {"role": "user", "content": "probe"}
_PROBE_OBSERVATION_TEXT = "0"


class ChatTemplateError(UserError, ValueError):
    """The tokenizer's chat template cannot be used for token-append multi-turn rollouts."""


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r:.80}")
    return list(messages)


class ChatFormatter:
    """Turns chat messages into token ids the way the agent loop appends them.

    Args:
        tokenizer: an HF tokenizer (``transformers`` fast tokenizer) with a chat template.
        chat_template: overrides ``tokenizer.chat_template``.
        template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}`` for
            Qwen3, ``{"tools": [...]}``), used for every render so prompt and observations agree.
        extra_stop_token_ids: more ids that end an assistant turn (e.g. a model's generation_config
            eos ids that the tokenizer does not name).
        observation_roles: roles the environment may reply with; each is probed at construction so an
            unusable template fails here, not in the middle of a rollout.
        strict: raise if encoding the observation suffix on its own gives different ids than encoding
            it after the preceding text (a tokenizer that merges across the turn boundary). With
            ``strict=False`` the append-only ids are still what the model is fed and trained on, they
            just differ from what ``apply_chat_template`` on the whole conversation would give.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, extra_stop_token_ids: Sequence[int] = (),
                 observation_roles: Sequence[str] = ("tool", "user"), strict: bool = True) -> None:
        if not hasattr(tokenizer, "apply_chat_template") or not hasattr(tokenizer, "encode"):
            raise TypeError(f"ChatFormatter needs an HF tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, "
                                    "which multi-turn rollouts need: use an Instruct model's tokenizer "
                                    "(model.tokenizer names another tokenizer directory) or pass chat_template=... "
                                    "to ChatFormatter")
        self.template_kwargs = dict(template_kwargs or {})
        reserved = {"add_generation_prompt", "tokenize", "chat_template", "conversation"} & set(self.template_kwargs)
        if reserved:
            raise ValueError(f"template_kwargs must not set {sorted(reserved)}; ChatFormatter controls them")
        if not observation_roles or not all(isinstance(r, str) and r for r in observation_roles):
            raise ValueError(f"observation_roles must be non-empty role names, got {observation_roles!r}")
        self.observation_roles = tuple(observation_roles)

        self._closing_text = self._measure_closing()
        self.closing_ids: list[int] = self.encode(self._closing_text)
        self.stop_token_ids: tuple[int, ...] = self._stop_ids(extra_stop_token_ids)
        for role in self.observation_roles:
            self._probe_observation(role, strict)

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Sequence[dict], add_generation_prompt: bool, **extra: Any) -> str:
        """The template's text for ``messages`` (no tokenization); ``extra``: more template variables
        for this render only (``tools=[...]`` of one request of the agent endpoint)."""
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **{**self.template_kwargs, **extra})
        except Exception as e:  # jinja errors, raise_exception in templates
            roles = [m.get("role") for m in messages]
            raise ChatTemplateError(f"chat template failed on roles {roles}: {type(e).__name__}: {e}") from e

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` alone. No BOS/EOS added: templates write their own special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _measure_closing(self) -> str:
        """Text the template puts after an assistant message's content (``<|im_end|>\\n``, ``<|end|>``)."""
        text = self.render([_PROBE_USER, {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
        i = text.find(_MARK)
        if i < 0:
            raise ChatTemplateError("the chat template does not render assistant content verbatim "
                                    f"(probe content {_MARK!r} is missing from {text!r:.200})")
        return text[i + len(_MARK):]

    def _stop_ids(self, extra: Sequence[int]) -> tuple[int, ...]:
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        # The template's end-of-turn marker stops generation when it is one atomic added token
        # (<|im_end|>, <|end|>); a plain-text closing such as "\n" must not stop the model mid-answer.
        added = set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})
        if self.closing_ids and self.closing_ids[0] in added:
            ids.append(self.closing_ids[0])
        for i in extra:
            if not isinstance(i, int) or not 0 <= i < len(self.tokenizer):
                raise ValueError(f"extra_stop_token_ids: {i!r} is not a valid id for this tokenizer")
            ids.append(i)
        return tuple(dict.fromkeys(ids))  # ordered, unique

    def _observation_suffix(self, role: str, text: str) -> str:
        """Template text after the assistant turn's closing: role markers, ``text``, generation prompt."""
        return self._suffix_after_assistant([{"role": role, "content": text}])

    def _suffix_after_assistant(self, messages: Sequence[dict], **extra: Any) -> str:
        """Template text after an assistant turn's closing for the ``messages`` that follow it, up to and
        including the next generation prompt (the render diff of the module docstring)."""
        full = self.render([_PROBE_USER, {"role": "assistant", "content": _MARK}, *messages],
                           add_generation_prompt=True, **extra)
        i = full.find(_MARK)
        rest = full[i + len(_MARK):] if i >= 0 else ""
        if i < 0 or not rest.startswith(self._closing_text):
            roles = [m.get("role") for m in messages]
            raise ChatTemplateError(f"the chat template closes an assistant turn differently when {roles} follow "
                                    f"(expected {self._closing_text!r} after the content, got {rest[:40]!r})")
        return rest[len(self._closing_text):]

    def _probe_observation(self, role: str, strict: bool) -> None:
        suffix = self._observation_suffix(role, _PROBE_OBSERVATION_TEXT)
        if _PROBE_OBSERVATION_TEXT not in suffix:
            raise ChatTemplateError(f"the chat template drops the content of a {role!r} message: {suffix!r}")
        head = self.render([_PROBE_USER, {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
        if strict and self.encode(head) + self.encode(suffix) != self.encode(head + suffix):
            raise ChatTemplateError(
                f"tokenizing the {role!r} observation suffix on its own gives different ids than tokenizing the "
                "whole conversation (a merge across the turn boundary); pass strict=False to accept that")

    # ------------------------------------------------------------------ the agent loop's calls
    def prompt_ids(self, messages: Sequence[dict], **extra: Any) -> list[int]:
        """Ids of the initial conversation plus the assistant generation prompt."""
        return self.encode(self.render(_check_messages(messages), add_generation_prompt=True, **extra))

    def continuation_ids(self, messages: Sequence[dict], action_ids: Sequence[int], **extra: Any) -> list[int]:
        """Ids to append after an assistant turn for every message that follows it (one or more tool
        results, a user message: rendered together, so a template that groups consecutive tool results,
        as Qwen3's does, groups them here too), up to the next generation prompt. The agent endpoint's
        call; ``observation_ids`` is this for one message of a probed role."""
        return self.closing_for(action_ids) + self.encode(self._suffix_after_assistant(_check_messages(messages),
                                                                                       **extra))

    def closing_for(self, action_ids: Sequence[int]) -> list[int]:
        """The part of the assistant turn's closing that ``action_ids`` did not already sample.

        Usually the action ends with the stop token (= the closing's first id), so this is the rest
        (Qwen3: ``\\n``; char template: nothing). A turn cut by the token limit gets the whole closing,
        as the template would have written it.
        """
        c = self.closing_ids
        for k in range(min(len(c), len(action_ids)), 0, -1):
            if list(action_ids[-k:]) == c[:k]:
                return c[k:]
        return list(c)

    def observation_ids(self, role: str, text: str, action_ids: Sequence[int]) -> list[int]:
        """Ids to append after an assistant turn for an environment message.

        Args:
            role: the message role (one of ``observation_roles``, e.g. "tool" or "user").
            text: the environment's reply.
            action_ids: the ids sampled in the assistant turn just before (to know how much of the
                turn's closing the policy already produced).
        Returns:
            closing remainder + role markers + ``text`` + the next assistant generation prompt.
        """
        if role not in self.observation_roles:
            raise ValueError(f"observation role {role!r} was not probed; ChatFormatter(observation_roles=...) "
                             f"has {self.observation_roles}")
        if not isinstance(text, str):
            raise TypeError(f"observation text must be a str, got {type(text).__name__}")
        return self.closing_for(action_ids) + self.encode(self._observation_suffix(role, text))

    def action_text(self, action_ids: Sequence[int]) -> str:
        """The text the environment sees for an action: one trailing stop token removed, specials skipped."""
        ids = list(action_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    # ------------------------------------------------------------------ demonstrations (SFT)
    def encode_demonstration(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """Ids and action mask of a finished conversation, built exactly as a rollout would build it.

        Used for SFT data so the policy is trained on the token layout it will see in RL: the prompt
        (messages before the first assistant turn), each assistant turn as ``encode(content)`` plus the
        stop token that ends it (mask True), each other message via ``observation_ids`` (mask False).
        """
        messages = _check_messages(messages)
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0 or messages[-1]["role"] != "assistant":
            raise ValueError("a demonstration needs at least one message before the first assistant message "
                             "and must end with an assistant message")
        ids = self.prompt_ids(messages[:first])
        mask = [False] * len(ids)
        last_action: list[int] = []
        for i, m in enumerate(messages[first:], start=first):
            if m["role"] == "assistant":
                if messages[i - 1]["role"] == "assistant":
                    raise ValueError(f"messages[{i}]: two assistant messages in a row")
                end = self.closing_ids[:1] if self.closing_ids and self.closing_ids[0] in self.stop_token_ids \
                    else list(self.stop_token_ids[:1])
                last_action = self.encode(m["content"]) + end
                ids += last_action
                mask += [True] * len(last_action)
            else:
                if messages[i - 1]["role"] != "assistant":
                    raise ValueError(f"messages[{i}]: a {m['role']!r} message must follow an assistant message "
                                     "(the agent loop appends one observation per action)")
                obs = self.observation_ids(m["role"], m["content"], last_action)
                ids += obs
                mask += [False] * len(obs)
        return ids, mask
