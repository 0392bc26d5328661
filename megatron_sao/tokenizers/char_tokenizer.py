"""The CPU demo's character-level tokenizer (one id per character, < 128 ids in all).

The demo model is tiny (a few hundred thousand parameters, ~256 positions), so a character vocabulary
keeps the embedding small and the chat format compact::

    <|user|>3*4+5<|end|><|assistant|>CALL 3*4<|end|><|tool|>12<|end|><|assistant|>...

It is a real ``transformers`` fast tokenizer built with the ``tokenizers`` library (a WordLevel model
over single characters: the pre-tokenizer isolates every character and the vocabulary maps each one
to an id), so every piece of the project that takes an HF tokenizer (the chat formatter, the HF and
vLLM rollout engines, checkpoint conversion) takes this one unchanged, and
``AutoTokenizer.from_pretrained(dir)`` loads what ``save_char_tokenizer(dir)`` wrote.

Id layout (stable; checkpoints depend on it): the special tokens first, in ``SPECIAL_TOKENS`` order
(``<pad>`` = 0), then ``\\t``, ``\\n`` and the 95 printable ASCII characters. Any other character
encodes to ``<unk>``. The end of an assistant turn is ``<|end|>``, which is also a stop token.
"""

from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SYSTEM, USER, ASSISTANT, TOOL, END = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, UNK, SYSTEM, USER, ASSISTANT, TOOL, END)
ROLE_TOKENS: dict[str, str] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
# \t and \n first so that a printable character's id is stable if more whitespace is ever added last.
CHARACTERS: str = "\t\n" + "".join(chr(c) for c in range(32, 127))
MAX_VOCAB_SIZE = 128

# Every message is `<|role|>content<|end|>`; the generation prompt is `<|assistant|>`. No newlines or
# spaces between turns: at ~256 positions every character of framing costs context. Unknown roles and
# non-string content raise inside the template, so a malformed task fails loudly at prompt time.
CHAR_CHAT_TEMPLATE: str = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('char tokenizer chat template: unknown role ' ~ message['role'] ~ "
    "'; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- if message['content'] is not string -%}"
    "{{ raise_exception('char tokenizer chat template: message content must be a string') }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_char_tokenizer(extra_special_tokens: tuple[str, ...] | list[str] = ()) -> PreTrainedTokenizerFast:
    """Build the character tokenizer with its chat template.

    Args:
        extra_special_tokens: more special tokens appended after the printable characters (used by the
            tests to build a Qwen3-shaped template, ``<|im_start|>``/``<|im_end|>``, over this vocab).

    Returns:
        A ``PreTrainedTokenizerFast`` with pad ``<pad>`` (id 0), eos ``<eos>``, unk ``<unk>`` and
        ``chat_template`` set; ``len(tok) <= 128``.
    """
    extra = tuple(extra_special_tokens)
    for tok in extra:
        if not isinstance(tok, str) or len(tok) < 2:
            raise ValueError(f"extra special token {tok!r} must be a string of 2+ characters "
                             "(single characters are already in the vocabulary)")
    clash = [t for t in extra if t in SPECIAL_TOKENS or extra.count(t) > 1]
    if clash:
        raise ValueError(f"extra special tokens repeat an existing or each other's token: {clash}")
    vocab_list = list(SPECIAL_TOKENS) + list(CHARACTERS) + list(extra)
    if len(vocab_list) > MAX_VOCAB_SIZE:
        raise ValueError(f"char tokenizer vocab would have {len(vocab_list)} entries; the limit is {MAX_VOCAB_SIZE}")
    vocab = {tok: i for i, tok in enumerate(vocab_list)}

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # `[\s\S]` (not `.`) so newlines are isolated too; "isolated" keeps each match as its own piece.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins pieces without the space the default WordLevel decoding would insert.
    core.decoder = decoders.Fuse()
    specials = list(SPECIAL_TOKENS) + list(extra)
    # Registering them as added tokens makes `<|end|>` in text encode to one id, not seven characters.
    core.add_special_tokens(specials)

    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[t for t in specials if t not in (PAD, EOS, UNK)],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="right",
    )
    tok.chat_template = CHAR_CHAT_TEMPLATE
    _check_ids(tok, vocab)
    return tok


def _check_ids(tok: PreTrainedTokenizerFast, vocab: dict[str, int]) -> None:
    """Fail at build time if the HF wrapper renumbered anything (checkpoints depend on the layout)."""
    got = tok.get_vocab()
    wrong = [t for t, i in vocab.items() if got.get(t) != i]
    if wrong or len(tok) != len(vocab):
        raise RuntimeError(f"char tokenizer ids changed inside transformers (tokens {wrong[:5]}, "
                           f"size {len(tok)} vs {len(vocab)}); the id layout must be stable")


def save_char_tokenizer(directory: str | os.PathLike,
                        extra_special_tokens: tuple[str, ...] | list[str] = ()) -> PreTrainedTokenizerFast:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json, chat template) to ``directory``.

    The directory is then loadable with ``AutoTokenizer.from_pretrained(directory)``; vLLM loads the
    same files through transformers. Returns the tokenizer that was saved.
    """
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"save_char_tokenizer: {directory!r} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    tok = build_char_tokenizer(extra_special_tokens)
    tok.save_pretrained(directory)
    _make_config_portable(os.path.join(directory, "tokenizer_config.json"), tok.chat_template)
    return tok


def _make_config_portable(config_path: str, chat_template: str) -> None:
    """Let loaders other than transformers 5.x read the directory too.

    transformers 5.x writes ``tokenizer_class: TokenizersBackend`` (a 5.x-only name) and keeps the
    template only in ``chat_template.jinja``. Older transformers (and vLLM builds pinned to them) know
    ``PreTrainedTokenizerFast`` and read ``chat_template`` from the config; 5.x maps the old class name
    to the same backend and prefers the .jinja file, so both fields describe the same tokenizer.
    """
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    tmp = config_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    os.replace(tmp, config_path)


def char_token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one special token or character, with a clear error if it is not in the vocabulary."""
    i = tok.convert_tokens_to_ids(token)
    if i is None or (i == tok.unk_token_id and token != UNK):
        raise KeyError(f"{token!r} is not in the char tokenizer's vocabulary")
    return int(i)
