"""``data.chat_template``: policy prompts through the tokenizer's real Jinja chat template (the chat demo
tokenizer's ChatML), the template's end-of-turn token in the stop set and the warm start, the checks
preflight makes, and a short real run (SFT + RL on the embedded engine) with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.contracts import stop_token_ids
from unirl.data.chat import end_of_turn_id, response_end_id
from unirl.data.datasets import load_prompts
from unirl.kernel import load_kernel
from unirl.models.tokenizer import build_chat_demo_tokenizer, load_tokenizer
from unirl.preflight import preflight
from unirl.rollout.batch import sft_samples

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "Answer with a number."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-tok")
    build_chat_demo_tokenizer(str(d))
    return d


def chat_config(tok_dir, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml",
                       [f"model.tokenizer={tok_dir}", "data.chat_template=true", f"data.system_prompt={SYSTEM}",
                        "data.max_prompt_tokens=96", *extra])


def test_prompt_tokens_equal_apply_chat_template_and_hand_built_chatml(tok_dir):
    tok = load_tokenizer(tok_dir)
    cfg = chat_config(tok_dir, "data.arith.n_train=16", "data.arith.n_eval=4")
    for split in ("train", "eval"):
        samples, _ = load_prompts(cfg, tok, split)
        assert len(samples) > 0
        for s in samples:
            conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": s.prompt_text}]
            assert s.prompt_ids == list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                                                return_dict=False))
            hand = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{s.prompt_text}<|im_end|>\n"
                    "<|im_start|>assistant\n")
            assert s.prompt_ids == tok.encode(hand, add_special_tokens=False)
            assert s.prompt_text.startswith("Q: "), "prompt_text stays the row's text (rewards read it)"


def test_the_end_of_turn_token_stops_a_turn_and_ends_the_warm_start(tok_dir):
    tok = load_tokenizer(tok_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id and end_of_turn_id(tok) == im_end
    cfg = chat_config(tok_dir)
    assert stop_token_ids(cfg, tok) == [tok.eos_token_id, im_end]
    assert stop_token_ids(load_config(None, []), tok) == [tok.eos_token_id], "off: eos only"
    samples, _ = load_prompts(cfg, tok, "train")
    (trace,) = sft_samples(samples[:1], tok, response_end_id(tok, True))
    assert trace.response_ids[-1] == im_end


def test_preflight_checks(tok_dir):
    kernel = load_kernel()

    def fields(*overrides):
        return {v.field: str(v) for v in preflight(load_config(ROOT / "recipes" / "arith-tiny.yaml",
                                                               list(overrides)), kernel)}
    got = fields("data.chat_template=true")  # the byte-level demo tokenizer has no template
    assert "no chat template" in got["data.chat_template"]
    got = fields(f"model.tokenizer={tok_dir}", "data.chat_template=true", "data.overlong=truncate")
    assert "cut the chat template's head" in got["data.overlong"] and "data.chat_template" not in got
    got = fields("data.system_prompt=hi")
    assert "data.chat_template is false" in got["data.system_prompt"]


@pytest.mark.slow
def test_a_short_run_with_the_chat_template(tok_dir, tmp_path):
    """SFT teaches answers that end with <|im_end|>; RL's turns then stop on it (a stop token, not eos)."""
    import types

    from unirl.kernel.hookspecs import hookimpl
    from unirl.trainer.loop import train

    seen = []
    probe = types.ModuleType("chat_probe")
    probe.unirl_on_rollout = hookimpl(lambda phase, samples: seen.extend(s for s in samples if phase == "train"))
    kernel = load_kernel()
    kernel.register(probe, entry_point="chat_probe", dist="chat-probe", version="0")
    cfg = chat_config(tok_dir, f"run.output_dir={tmp_path}", "run.name=chat", "sft.steps=20", "sft.batch_size=16",
                      "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "trainer.progress=false",
                      "trainer.plot=false", "trainer.export_hf=false", "data.arith.n_train=64", "data.arith.n_eval=4",
                      "rollout.n=4", "rollout.max_new_tokens=8",
                      "model.build={hidden_size: 64, intermediate_size: 128}")
    result = train(cfg, kernel)
    assert result.steps_done == 2
    rows = [json.loads(line) for line in (tmp_path / "chat" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    tok = load_tokenizer(tok_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert len(seen) == 32 and all(s.prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>") for s in seen)
    ended = [s.response_ids[-1] for s in seen if len(s.response_ids) < 8]
    assert im_end in ended, "after the warm start, turns end with the template's end-of-turn token"
    assert all(t in (im_end, tok.eos_token_id) for t in ended), "a turn shorter than the cap ended on a stop token"


# ----------------------------------------------------------------------------- chat-message-list prompts
CONVERSATIONS = [
    [{"role": "user", "content": "Q: 2 + 3 = ?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 4 + 4 = ?"}],
    [{"role": "user", "content": "Q: 1 + 1 = ?"}, {"role": "assistant", "content": "3"},
     {"role": "user", "content": "Q: try again: 1 + 1 = ?"}],
]


def write_conversations(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_message_list_prompts_render_as_the_hand_built_conversation(tok_dir, tmp_path, ext):
    """TRL's / verl's conversational prompts (a list of {role, content}) render through the template to
    the ChatML written out by hand, with ``data.system_prompt`` first unless the list has a system turn;
    ``prompt_text`` is the last user turn and the whole list is kept in ``meta["messages"]``."""
    rows = [{"prompt": c, "answer": str(i)} for i, c in enumerate(CONVERSATIONS)]
    path = write_conversations(tmp_path / f"train{ext}", rows)
    tok = load_tokenizer(tok_dir)
    cfg = chat_config(tok_dir, f"data.source={path}", f"data.eval_source={path}", "trainer.prompts_per_step=2",
                      "data.max_prompt_tokens=256")
    assert not preflight(cfg, load_kernel()), "valid message lists pass preflight"
    samples, _ = load_prompts(cfg, tok, "train")

    def chatml(turns):
        return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"

    hand = [chatml([("system", SYSTEM), ("user", "Q: 2 + 3 = ?")]),
            chatml([("system", "Be brief."), ("user", "Q: 4 + 4 = ?")]),
            chatml([("system", SYSTEM), ("user", "Q: 1 + 1 = ?"), ("assistant", "3"),
                    ("user", "Q: try again: 1 + 1 = ?")])]
    assert [s.prompt_ids for s in samples] == [tok.encode(h, add_special_tokens=False) for h in hand]
    assert [s.prompt_text for s in samples] == ["Q: 2 + 3 = ?", "Q: 4 + 4 = ?", "Q: try again: 1 + 1 = ?"]
    assert [s.meta["messages"] for s in samples] == CONVERSATIONS


def test_bad_message_lists_and_lists_without_the_template_are_named_in_preflight(tok_dir, tmp_path):
    bad = [{"prompt": [{"role": "bot", "content": "hi"}], "answer": "1"},
           {"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "answer": "2"},
           {"prompt": [], "answer": "3"},
           {"prompt": [{"role": "user", "content": 7}], "answer": "4"}]
    path = write_conversations(tmp_path / "bad.jsonl", bad)
    got = {v.field: str(v) for v in preflight(chat_config(tok_dir, f"data.source={path}", f"data.eval_source={path}",
                                                          "trainer.prompts_per_step=2"), load_kernel())}
    text = got["data.source"]
    for why in ("line 1", "role 'bot'", "line 2", "last message is a 'assistant' turn", "line 3", "non-empty list",
                "line 4", "content must be a string"):
        assert why in text, (why, text)
    good = write_conversations(tmp_path / "good.jsonl", [{"prompt": c, "answer": "1"} for c in CONVERSATIONS])
    got = {v.field: str(v) for v in preflight(load_config(ROOT / "recipes" / "arith-tiny.yaml", [
        f"data.source={good}", f"data.eval_source={good}", "trainer.prompts_per_step=2"]), load_kernel())}
    assert "chat-message lists" in got["data.chat_template"] and "data.chat_template: true" in got["data.chat_template"]
