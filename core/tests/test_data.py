"""Prompt data: arith generator, file loading through HF datasets, validation, overlong policy, cursor."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unirl.config import ArithSection, RunConfig
from unirl.data.arith import arith_rows, arith_triples
from unirl.data.datasets import PromptCursor, load_prompts
from unirl.kernel.errors import DataError
from unirl.samples import Sample


class ByteTok:
    """A stand-in for the byte-level demo tokenizer: one token per byte, offset by 3 specials."""

    bos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        ids = [b + 3 for b in text.encode()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode()


TOK = ByteTok()


def write_jsonl(path, rows, blank_after=()):
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if i in blank_after:
                f.write("\n")
    return path


def cfg(**data) -> RunConfig:
    return RunConfig.model_validate({"data": data})


# ------------------------------------------------------------------------------------------ arith


def test_arith_rows_shape_and_answers():
    section = ArithSection(n_train=50, n_eval=10, max_operand=9, ops=["+", "-", "*"], seed=7)
    rows = arith_rows(section, "train")
    assert len(rows) == 50 and len(arith_rows(section, "eval")) == 10
    for r in rows + arith_rows(section, "eval"):
        assert r["prompt"].startswith("Q: ") and r["prompt"].endswith("=? A:")
        expr = r["prompt"][3:-5]
        assert eval(expr) == r["answer"]  # noqa: S307 - our own generated "a+b"
        assert isinstance(r["answer"], int)


def test_arith_literal_format():
    section = ArithSection(n_train=1, n_eval=1, max_operand=0, ops=["+", "*"], seed=0)
    rows = arith_rows(section, "train") + arith_rows(section, "eval")
    assert sorted(r["prompt"] for r in rows) == ["Q: 0*0=? A:", "Q: 0+0=? A:"]
    assert [r["answer"] for r in rows] == [0, 0]


def test_arith_deterministic_and_disjoint():
    section = ArithSection(n_train=2000, n_eval=64, max_operand=20, ops=["+", "-"], seed=1234)
    assert arith_rows(section, "train") == arith_rows(section, "train")
    assert arith_rows(section, "eval") == arith_rows(section, "eval")
    other = section.model_copy(update={"seed": 99})
    assert arith_rows(other, "eval") != arith_rows(section, "eval")

    pool, held = arith_triples(section)
    assert len(held) == 64 and len(set(held)) == 64
    assert not set(pool) & set(held)
    train_prompts = {r["prompt"] for r in arith_rows(section, "train")}
    eval_prompts = {r["prompt"] for r in arith_rows(section, "eval")}
    assert len(eval_prompts) == 64
    assert not train_prompts & eval_prompts
    # 2 ops x 21 x 21 = 882 problems, 818 in the pool: 2000 train rows use every pool problem
    assert len(train_prompts) == 882 - 64
    # eval does not depend on n_train
    assert arith_rows(section.model_copy(update={"n_train": 10}), "eval") == arith_rows(section, "eval")


def test_arith_too_many_eval_problems():
    with pytest.raises(DataError, match="n_eval=9 leaves no training problems"):
        arith_rows(ArithSection(n_eval=9, max_operand=2, ops=["+"]), "train")


def test_load_prompts_arith():
    config = cfg(arith={"n_train": 30, "n_eval": 5, "max_operand": 9})
    train, stats = load_prompts(config, TOK, "train")
    assert stats == {"rows": 30, "rejected_overlong": 0, "truncated": 0, "source": "arith:train"}
    assert [s.id for s in train] == [f"p{i}" for i in range(30)]
    s = train[0]
    assert s.prompt_ids == TOK.encode(s.prompt_text, add_special_tokens=False)
    assert s.prompt_ids[0] != TOK.bos_token_id  # no special tokens added
    evals, estats = load_prompts(config, TOK, "eval")
    assert len(evals) == 5 and estats["source"] == "arith:eval"


# ------------------------------------------------------------------------------------------ files


def test_jsonl_loads(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "What is 2+2?", "gold": 4, "extra": "x"},
        {"question": "What is 3+4?", "gold": "7", "extra": "y"},
    ], blank_after={0})
    samples, stats = load_prompts(cfg(source=str(path), prompt_field="question", answer_field="gold"), TOK, "train")
    assert stats == {"rows": 2, "rejected_overlong": 0, "truncated": 0, "source": str(path)}
    assert [(s.id, s.prompt_text) for s in samples] == [("p0", "What is 2+2?"), ("p1", "What is 3+4?")]
    assert samples[0].prompt_ids == [b + 3 for b in b"What is 2+2?"]
    assert samples[0].status == "pending" and samples[0].answer is not None


def test_parquet_loads(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["Q: 1+1=? A:", "Q: 2*3=? A:", "Q: 9-4=? A:"], "answer": [2, 6, 5]}), path)
    samples, stats = load_prompts(cfg(source=str(path)), TOK, "train")
    assert stats["rows"] == 3
    assert [(s.id, s.prompt_text, s.answer) for s in samples] == [
        ("p0", "Q: 1+1=? A:", 2), ("p1", "Q: 2*3=? A:", 6), ("p2", "Q: 9-4=? A:", 5)]


def test_eval_source(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": 1}])
    with pytest.raises(DataError, match=r"data.eval_source is not set.*set data.eval_source"):
        load_prompts(cfg(source=str(train)), TOK, "eval")
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "held out", "answer": 2}])
    samples, stats = load_prompts(cfg(source=str(train), eval_source=str(ev)), TOK, "eval")
    assert [s.prompt_text for s in samples] == ["held out"] and stats["source"] == str(ev)


def test_bad_rows_all_reported_with_line_numbers(tmp_path):
    rows = [
        {"prompt": "ok", "answer": 1},
        {"answer": 2},  # line 2: prompt missing
        {"prompt": "ok", "answer": 3},
        {"prompt": "no answer"},  # line 5 (a blank line follows row 3 at line 4)
        {"x": 0},  # line 6: both missing, one bad row
        {"prompt": 7, "answer": 4},  # line 7: non-string prompt
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows, blank_after={2})
    with pytest.raises(DataError) as info:
        load_prompts(cfg(source=str(path)), TOK, "train")
    msg = str(info.value)
    assert "bad.jsonl" in msg and "4 bad row(s) of 6" in msg
    assert "line 2: field 'prompt' is missing or null" in msg
    assert "line 5: field 'answer' is missing or null" in msg
    assert "line 6: field 'prompt' is missing or null; field 'answer' is missing or null" in msg
    assert "line 7: field 'prompt' must be a string or a list of chat messages, got int (7)" in msg
    assert "available columns: prompt, answer, x" in msg
    assert "data.prompt_field" in msg and "data.answer_field" in msg


def test_line_numbers_count_blank_lines(tmp_path):
    # consistent types, so HF datasets reads it (skipping the blank lines); labels are still file lines
    rows = [{"prompt": "ok", "answer": 1}, {"prompt": "", "answer": 2}, {"prompt": "ok"}]
    path = write_jsonl(tmp_path / "gaps.jsonl", rows, blank_after={0, 1})
    with pytest.raises(DataError) as info:
        load_prompts(cfg(source=str(path)), TOK, "train")
    msg = str(info.value)
    assert "line 3: field 'prompt' is an empty string" in msg
    assert "line 5: field 'answer' is missing or null" in msg


def test_bad_rows_capped(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"prompt": "ok", "answer": 1}] + [{"answer": i} for i in range(8)])
    with pytest.raises(DataError) as info:
        load_prompts(cfg(source=str(path)), TOK, "train")
    msg = str(info.value)
    assert "8 bad row(s) of 9" in msg and "line 6:" in msg and "line 7:" not in msg
    assert "... and 3 more" in msg


def test_wrong_column_name(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["a", "b"], "answer": [1, 2]}), path)
    with pytest.raises(DataError) as info:
        load_prompts(cfg(source=str(path)), TOK, "train")
    msg = str(info.value)
    assert "cols.parquet" in msg and "data.prompt_field = 'prompt'" in msg
    assert "available columns: question, answer" in msg


def test_parquet_non_string_prompt_rows(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "answer": [1, 2]}), path)
    with pytest.raises(DataError, match=r"(?s)ints.parquet.*row 1: field 'prompt' must be a string.*row 2:"):
        load_prompts(cfg(source=str(path)), TOK, "train")


def test_missing_path_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match=r"data.source: .*nope.jsonl does not exist"):
        load_prompts(cfg(source=str(tmp_path / "nope.jsonl")), TOK, "train")
    txt = tmp_path / "x.txt"
    txt.write_text("prompt,answer\na,1\n")
    with pytest.raises(DataError, match=r"unsupported extension '.txt'; supported: .jsonl, .json, .parquet, .csv"):
        load_prompts(cfg(source=str(txt)), TOK, "train")


def test_malformed_jsonl(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{not json\n\n[1, 2]\n')
    with pytest.raises(DataError) as info:
        load_prompts(cfg(source=str(path)), TOK, "train")
    msg = str(info.value)
    assert "broken.jsonl: 2 bad row(s)" in msg
    assert "line 2: invalid JSON" in msg and "line 4: expected a JSON object, got list" in msg


def test_empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl has no rows"):
        load_prompts(cfg(source=str(path)), TOK, "train")


def test_bad_parquet(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"could not read .*junk.parquet as Parquet"):
        load_prompts(cfg(source=str(path)), TOK, "train")


def test_overlong_reject_and_truncate(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [
        {"prompt": "short", "answer": 1},  # 5 tokens
        {"prompt": "a long preamble. Q: 1+1=? A:", "answer": 2},  # 28 tokens
        {"prompt": "exactly8", "answer": 3},  # 8 tokens: kept as is
    ])
    samples, stats = load_prompts(cfg(source=str(path), max_prompt_tokens=8), TOK, "train")
    assert stats == {"rows": 3, "rejected_overlong": 1, "truncated": 0, "source": str(path)}
    assert [s.id for s in samples] == ["p0", "p2"]  # ids keep the dataset index

    samples, stats = load_prompts(cfg(source=str(path), max_prompt_tokens=8, overlong="truncate"), TOK, "train")
    assert stats == {"rows": 3, "rejected_overlong": 0, "truncated": 1, "source": str(path)}
    long = samples[1]
    assert long.id == "p1" and len(long.prompt_ids) == 8
    assert long.prompt_text == "1+1=? A:"  # the tail (the question's end) is kept
    assert long.meta["truncated_prompt"] is True and samples[0].meta == {}


def test_all_rows_overlong(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 20, "answer": 1}, {"prompt": "y" * 30, "answer": 2}])
    with pytest.raises(DataError, match=r"all 2 prompts are longer than data.max_prompt_tokens=4 tokens \(longest: 30\)"):
        load_prompts(cfg(source=str(path), max_prompt_tokens=4), TOK, "train")


def test_real_demo_tokenizer():
    tokenizer_mod = pytest.importorskip("unirl.models.tokenizer")
    tok = tokenizer_mod.build_demo_tokenizer()
    samples, _ = load_prompts(cfg(arith={"n_train": 3, "n_eval": 1}, max_prompt_tokens=5, overlong="truncate"),
                              tok, "train")
    assert all(len(s.prompt_ids) == 5 and s.prompt_text == "=? A:" for s in samples)
    assert tok.bos_token_id not in samples[0].prompt_ids


# ------------------------------------------------------------------------------------------ cursor


def roots(n):
    return [Sample(id=f"p{i}", prompt_ids=[i]) for i in range(n)]


def test_cursor_resume_matches_straight_run():
    straight = PromptCursor(roots(10), batch_size=3, seed=5)
    expected = [[s.id for s in straight.next_batch()] for _ in range(6)]

    first = PromptCursor(roots(10), batch_size=3, seed=5)
    got = [[s.id for s in first.next_batch()] for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptCursor(roots(10), batch_size=3, seed=5)
    resumed.load_state_dict(state)
    got += [[s.id for s in resumed.next_batch()] for _ in range(3)]
    assert got == expected


def test_cursor_epochs_shuffle_and_never_repeat_within_batch():
    cursor = PromptCursor(roots(10), batch_size=4, seed=0)
    batches = [[s.id for s in cursor.next_batch()] for _ in range(6)]  # 2 batches per epoch
    assert all(len(set(b)) == 4 for b in batches)
    epoch0 = batches[0] + batches[1]
    assert len(set(epoch0)) == 8
    assert cursor.state_dict()["epoch"] == 2
    assert batches[:2] != batches[2:4]  # reshuffled per epoch
    # batches are copies: mutating one does not touch the cursor's prompts
    b = cursor.next_batch()
    b[0].prompt_ids.append(99)
    assert all(99 not in s.prompt_ids for s in cursor.prompts)


def test_cursor_errors():
    with pytest.raises(DataError, match="cannot fill one batch of trainer.prompts_per_step=5"):
        PromptCursor(roots(3), batch_size=5)
    cursor = PromptCursor(roots(4), batch_size=2)
    state = cursor.state_dict()
    with pytest.raises(DataError, match="checkpoint was taken with 4 training prompts"):
        PromptCursor(roots(5), batch_size=2).load_state_dict(state)


def test_data_violations_read_every_file_before_any_model(tmp_path):
    """Preflight's data read: each broken file is one violation naming the field, the line and the fix."""
    from unirl.config import load_config
    from unirl.data.datasets import data_violations

    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"prompt": "q{i}", "answer": {i}}}\n' for i in range(3)))
    cases = {
        "latin1.jsonl": (b'{"prompt": "caf\xe9", "answer": 1}\n', "line 1: not UTF-8"),
        "malformed.jsonl": (b'{"prompt": "a", "answer": 1}\n{oops\n', "line 2: invalid JSON"),
        "empty.jsonl": (b"", "has no rows"),
        "noanswer.jsonl": (b'{"prompt": "a"}\n', "data.answer_field"),
    }
    for name, (raw, needle) in cases.items():
        (tmp_path / name).write_bytes(raw)
        config = load_config(None, [f"data.source={tmp_path / name}", f"data.eval_source={good}"])
        found = data_violations(config)
        assert len(found) == 1 and found[0].field == "data.source" and needle in found[0].message, (name, found)
    small = load_config(None, [f"data.source={good}", f"data.eval_source={good}", "trainer.prompts_per_step=8"])
    (v,) = data_violations(small)
    assert "fewer than one batch" in v.message and "trainer.prompts_per_step" in v.fix
    no_eval = load_config(None, [f"data.source={good}", "trainer.prompts_per_step=2"])
    (v,) = data_violations(no_eval)
    assert v.field == "data.eval_source"
    assert data_violations(load_config(None, [])) == []  # the built-in arith source
