"""The demo tokenizer: byte-level, no merges, built locally with ``tokenizers`` (nothing downloaded).

Every byte is one token, so every digit is its own token (arithmetic stays learnable) and any text
round-trips exactly. The vocabulary is the three special tokens followed by the 256 byte symbols in
byte order: 259 entries, the same on every machine. Saved with ``save_pretrained`` it is a plain
``tokenizer.json`` directory that transformers and vLLM load.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins ByteLevel uses for bytes, in byte order (GPT-2's table)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # a set: order it by the byte each symbol stands for
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    symbols = [table[b] for b in range(256)]
    if set(symbols) != set(alphabet):  # pragma: no cover - a tokenizers release changed the table
        raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
    return symbols


def _build_backend() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_demo_tokenizer(cache_dir: str | None = None, *, words: Iterable[str] = ()) -> Any:
    """The byte-level demo tokenizer as a ``transformers.PreTrainedTokenizerFast`` (pad, eos, bos set).

    With ``cache_dir`` it is also written there (or read back when already there), so a run directory
    or an exported model holds the exact tokenizer it was trained with.

    ``words`` become one token each, lower case and capitalised: a word of letters only where it stands as
    a whole word, a run of punctuation (``":{"``) wherever it appears. Every other text stays bytes. Why:
    the search demo's lookup trace is 346 bytes, most of them template and JSON; as words it is ~130
    tokens, while a made-up name stays its letters wherever it appears (`` Lepoz`` in the question,
    ``"Lepoz"`` in the call, the same letter tokens), so copying it is the same task as with bytes.
    :func:`build_word_demo_tokenizer` instead merges pieces, and a name falls into whatever pieces its
    merges make.
    """
    if cache_dir is not None and Path(cache_dir, "tokenizer.json").is_file():
        return load_tokenizer(cache_dir)
    tok = _wrap(_build_backend())
    if words:
        from tokenizers import AddedToken

        forms = sorted({f for w in words for f in ((w, w.capitalize()) if w[:1].isalpha() else (w,)) if len(f) > 1})
        tok.add_tokens([AddedToken(f, single_word=f[0].isalpha(), normalized=False) for f in forms])
    if cache_dir is not None:
        save_tokenizer(tok, cache_dir)
    return tok


def demo_vocab_size() -> int:
    """``len(build_demo_tokenizer())`` without importing transformers: the memory plan sizes a
    ``model.build`` model's embedding by it, and ``unirl plan`` stays out of transformers."""
    return _build_backend().get_vocab_size(with_added_tokens=True)


def _wrap(backend: Any) -> Any:
    """A ``tokenizers`` backend as the demo tokenizers' ``PreTrainedTokenizerFast``: pad / eos / bos set,
    left padding (generation appends on the right), and no clean-up, so decoding round-trips exactly."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                   padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=1 << 20)


def save_tokenizer(tokenizer: Any, path: str | Path) -> None:
    """Write ``tokenizer`` as an HF tokenizer directory (``tokenizer.json`` + configs)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer directory written by :func:`save_tokenizer` (or any local HF tokenizer)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {p} does not exist")
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


#: ChatML, as Qwen's instruct models write it: ``<|im_start|>role\ncontent<|im_end|>\n`` per turn, then
#: ``<|im_start|>assistant\n`` as the generation prompt. A real Jinja template, rendered by transformers.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")


def build_chat_demo_tokenizer(cache_dir: str | None = None) -> Any:
    """The demo tokenizer plus ChatML: ``<|im_start|>`` / ``<|im_end|>`` as special tokens (261 entries)
    and :data:`CHATML_TEMPLATE` as its chat template, so ``data.chat_template`` runs end to end on a tiny
    model (``model.tokenizer`` pointing at a directory this wrote). Its end-of-turn token (``<|im_end|>``)
    is not eos, as in real instruct tokenizers."""
    if cache_dir is not None and Path(cache_dir, "tokenizer.json").is_file():
        return load_tokenizer(cache_dir)
    tok = build_demo_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    tok.chat_template = CHATML_TEMPLATE
    if cache_dir is not None:
        save_tokenizer(tok, cache_dir)
    return tok


def build_word_demo_tokenizer(words: Iterable[str], vocab_size: int, cache_dir: str | None = None) -> Any:
    """The demo tokenizer plus byte-level BPE merges learnt over ``words`` (a domain's vocabulary), so each
    of them, with or without a leading space, is one token (about ``vocab_size`` entries in all).

    Why: a byte-level model pays per character, and a tiny one does not learn to copy a word out of a
    few hundred bytes of prompt (the TextWorld demo: a 2-layer model wrote plausible words, never the
    listed object; docs/agentic.md). With one token per word the same prompt is ~3.5x shorter and a copy
    is one token. The special tokens are the demo tokenizer's (same ids), every byte is still a token
    (any text round-trips), and pre-tokenization splits words as GPT-2 does, so merges never cross a word.
    Deterministic: the same words give the same vocabulary."""
    if cache_dir is not None and Path(cache_dir, "tokenizer.json").is_file():
        return load_tokenizer(cache_dir)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=_byte_symbols(), show_progress=False)
    forms = sorted({f for w in words for f in (w, " " + w, w.capitalize(), " " + w.capitalize())})
    backend.train_from_iterator(forms * 8, trainer)  # equal counts: every form is merged whole, shortest first
    tok = _wrap(backend)
    if cache_dir is not None:
        save_tokenizer(tok, cache_dir)
    return tok
