"""Tokenizers owned by the project (the CPU demo's character tokenizer)."""

from megatron_sao.tokenizers.char_tokenizer import (
    CHAR_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    char_token_id,
    save_char_tokenizer,
)

__all__ = ["CHAR_CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_char_tokenizer", "char_token_id", "save_char_tokenizer"]
