"""The byte-level demo tokenizer: exact round trips, one token per digit, a fixed vocabulary."""

from __future__ import annotations

import string

import pytest

from unirl.models.tokenizer import SPECIAL_TOKENS, build_demo_tokenizer, load_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


TEXTS = [
    "Q: 12+7=? A:",
    " 19",
    "Q: 3-15=? A: -12",
    string.printable,
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "",
    "x",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # encode adds no special tokens
    assert len(ids) == len(text.encode())  # one token per byte


def test_round_trip_non_ascii(tok):
    text = "é ü 中 → ok"
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_distinct_tokens(tok):
    ids = [tok.encode(d) for d in string.digits]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == 10
    assert tok.encode("1234567890") == [tok.encode(d)[0] for d in "1234567890"]


def test_special_tokens_and_size(tok):
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<pad>", "<eos>", "<bos>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert len(tok) == 259 < 512
    ids = tok.encode(" 19") + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == " 19"


def test_vocabulary_is_deterministic(tok):
    again = build_demo_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert again.encode(string.printable) == tok.encode(string.printable)


def test_save_and_load(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, 2)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


def test_cache_dir_writes_then_reads(tmp_path):
    first = build_demo_tokenizer(cache_dir=str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file()
    second = build_demo_tokenizer(cache_dir=str(tmp_path))
    assert second.get_vocab() == first.get_vocab()


def test_load_missing_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_word_tokenizer_makes_each_word_one_token_and_keeps_bytes(tmp_path):
    """``build_word_demo_tokenizer``: every given word is one token with and without a leading space (and
    capitalised), the specials keep the demo tokenizer's ids, any text still round-trips byte for byte, a
    word it was not given falls back to pieces, and the same words give the same vocabulary."""
    from unirl.models.tokenizer import build_word_demo_tokenizer

    words = ["chest", "latchkey", "close", "examine", "butterfly", "unlock"]
    tok = build_word_demo_tokenizer(words, 4096, cache_dir=str(tmp_path / "w"))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    for w in words:
        for form in (w, " " + w, w.capitalize(), " " + w.capitalize()):
            assert len(tok.encode(form)) == 1, form
    text = "close chest | examine latchkey\n> ünïcode \x00 zq 12"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" zyzzyva")) > 1  # not given: byte pieces, not an unknown token
    assert len(tok.encode("Commands: close chest | examine latchkey")) < len("Commands: close chest | examine latchkey") / 2
    again = build_word_demo_tokenizer(list(reversed(words)), 4096)
    assert again.get_vocab() == tok.get_vocab()
    assert load_tokenizer(tmp_path / "w").get_vocab() == tok.get_vocab()  # written where asked, loads back


def test_demo_tokenizer_with_words_keeps_every_other_text_as_bytes(tmp_path):
    """``build_demo_tokenizer(words=)``: a given word is one token (lower case and capitalised) where it
    stands whole, a punctuation run wherever it appears; a word it was not given is its bytes, the same
    tokens after a space as after a quote (a name copied into JSON); any text round-trips."""
    words = ["capital", "country", "query", "tool_call", '":"', '"}}</']
    tok = build_demo_tokenizer(str(tmp_path / "w"), words=words)
    plain = build_demo_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2) and len(tok) == len(plain) + 10

    def pieces(text):
        return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]

    assert pieces('<tool_call>{"query":"capital Lepoz"}}</tool_call>') == [
        "<", "tool_call", ">", "{", '"', "query", '":"', "capital", " ", "L", "e", "p", "o", "z", '"}}</',
        "tool_call", ">"]
    assert pieces(" Capital capitals encountry") == [" ", "Capital", " ", *"capitals", " ", *"encountry"]
    assert tok.encode(" Lepoz", add_special_tokens=False) == plain.encode(" Lepoz", add_special_tokens=False)
    text = 'Q: the country where Lepoz was born? {"query":"Lepoz"} ünï \x00'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert load_tokenizer(tmp_path / "w").get_vocab() == tok.get_vocab()  # written where asked, loads back
