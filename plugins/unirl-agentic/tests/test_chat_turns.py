"""``data.chat_template`` in a multi-turn drive: on the real TorchEngine (tiny random Qwen3) and the
real ChatML Jinja template of the chat demo tokenizer, every observation is appended as a template
turn, so a trajectory's prompt + response ids are exactly what ``apply_chat_template`` renders for the
conversation built by hand from its turns (the oracle)."""

from __future__ import annotations

import pytest
from agentic_support import CountdownEnv
from unirl_agentic.controller import AgenticRolloutController

from unirl.api import RunConfig, Sample, SamplingParams, build_chat_demo_tokenizer, end_of_turn_id
from unirl.data.chat import chat_prompt_ids

SYSTEM = "You may call tools."


@pytest.fixture(scope="module")
def chat_tok():
    return build_chat_demo_tokenizer()


@pytest.fixture(scope="module")
def chat_engine(chat_tok):
    from unirl.api import Qwen3Adapter, build_engine

    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=chat_tok)
    yield eng
    eng.close()


def test_a_multi_turn_drive_renders_as_the_hand_built_conversation(chat_engine, chat_tok):
    tok, eot = chat_tok, end_of_turn_id(chat_tok)
    questions = {f"p{i}": f"Q: {i}*7=? A:" for i in range(3)}

    def draw(k):
        return [Sample(id=pid, prompt_ids=chat_prompt_ids(tok, q, SYSTEM)[0], prompt_text=q, answer=0)
                for pid, q in list(questions.items())[:k]]

    ctl = AgenticRolloutController(chat_engine, CountdownEnv(lambda s: 3), tok, reward_fn=lambda text, s: 0.0,
                                   base_seed=3, chat_template=True)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(tok.eos_token_id, eot))
    out = ctl.collect(draw, groups=3, n=2, sampling=sampling)
    ctl.close()
    assert len(out) == 6
    exact = 0  # noqa: F841 - trajectories also compared with the template's own ids
    for s in out:
        assert [seg.kind for seg in s.segments] == ["model", "observation", "model", "observation", "model"]
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": questions[s.prompt_id]}]
        # the token-level oracle: ChatML spelled out by hand around the generated ids themselves (a random
        # model's bytes need not be UTF-8, so its text cannot always be re-encoded to its tokens)
        start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        spelled = ([start] + enc(f"system\n{SYSTEM}") + [end] + enc("\n") + [start]
                   + enc(f"user\n{questions[s.prompt_id]}") + [end] + enc("\n") + [start] + enc("assistant\n"))
        for seg in s.segments:
            ids = s.response_ids[seg.start:seg.end]
            if seg.kind == "model" and seg is not s.segments[-1]:
                turn = ids[:-1] if ids[-1] == eot else ids  # a turn that hit max_new_tokens is closed by the next
                conversation.append({"role": "assistant", "content": tok.decode(turn)})
                spelled += turn + [end]
            elif seg.kind == "observation":
                t = seg.turn + 1
                content = f"\n<tool_response>obs{t}</tool_response>\n"
                conversation.append({"role": "tool", "content": content})
                spelled += enc("\n") + [start] + enc(f"tool\n{content}") + [end] + enc("\n") + [start] + enc("assistant\n")
        last = s.segments[-1]
        mine = s.prompt_ids + s.response_ids[: last.start]
        text = tok.decode(mine)
        assert text == tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert mine == spelled, "every turn is ChatML, token for token, around the generated ids"
        if tok.encode(text, add_special_tokens=False) == mine:  # the turns' text re-encodes: Jinja's ids too
            hand = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert mine == list(hand)
            exact += 1
        assert text.count("<|im_start|>tool\n") == 2 and text.endswith("<|im_start|>assistant\n")
        assert all(s.loss_mask[i] == 0 for seg in s.segments if seg.kind == "observation"
                   for i in range(seg.start, seg.end)), "template tokens of a tool turn are never trained"


def test_warm_start_traces_use_the_template(chat_tok):
    from unirl_agentic.options import AgenticOptions

    from unirl.api import chat_turn_ids

    tok, eot = chat_tok, end_of_turn_id(chat_tok)
    ctl = AgenticRolloutController(None, CountdownEnv(lambda s: 1), tok, reward_fn=lambda text, s: 0.0,
                                   options=AgenticOptions(warm_start="calculator"), chat_template=True)
    p = Sample(id="p0", prompt_ids=chat_prompt_ids(tok, "Q: 3*4=? A:")[0], prompt_text="Q: 3*4=? A:", answer=12)
    (trace,) = ctl.warm_start_samples([p])
    ctl.close()
    model, obs, answer = trace.segments
    assert trace.response_ids[model.end - 1] == eot and trace.response_ids[answer.end - 1] == eot
    text = tok.decode(trace.response_ids[obs.start:obs.end])
    assert text.startswith("\n<|im_start|>tool\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    content = text.removeprefix("\n<|im_start|>tool\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n")
    assert "12" in content and trace.response_ids[obs.start:obs.end] == chat_turn_ids(tok, content)
