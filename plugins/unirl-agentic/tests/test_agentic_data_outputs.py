"""``unirl agentic-data`` never overwrites what it did not write (issue 66): ``data.source`` /
``data.eval_source`` may name the user's own data, ``model.tokenizer`` the user's own tokenizer. Each is
claimed before anything is generated: exit 2, one ``error:`` line naming the field, the path and the fix,
and the user's files byte for byte as they were. Its own earlier files are replaced; a file of its own
that the user edited since is the user's again.

Through the real CLI entry (``unirl.cli.main``, which finds the plugin's command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl import cli

ROOT = Path(__file__).resolve().parents[3]
SEARCH = str(ROOT / "recipes" / "search-tiny.yaml")
SMALL = ["plugins.agentic.search.seed=3", "plugins.agentic.search.people=60", "plugins.agentic.search.countries=5",
         "plugins.agentic.search.n_eval=8", "trainer.progress=false"]
USER = b'{"prompt": "my own question", "answer": "42"}\n\xff not UniRL\'s\n'


def argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["agentic-data", SEARCH, *SMALL, f"data.source={tmp_path / 'train.jsonl'}",
            f"data.eval_source={tmp_path / 'eval.jsonl'}", f"model.tokenizer={tmp_path / 'tok'}", *extra]


def main(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def refused(code: int, text: str, *words: str) -> None:
    assert code == 2, text
    lines = text.strip().splitlines()
    assert "Traceback" not in text and len(lines) == 1 and lines[0].startswith("error: "), text
    missing = [w for w in words if w not in text]
    assert not missing, f"the message lacks {missing}:\n{text}"


@pytest.mark.parametrize("field,name", [("data.source", "train.jsonl"), ("data.eval_source", "eval.jsonl")])
def test_a_users_data_file_is_refused_and_left_byte_for_byte(tmp_path, capsys, field, name):
    (tmp_path / name).write_bytes(USER)
    code, text = main(argv(tmp_path), capsys)
    refused(code, text, field, str(tmp_path / name), "--force", "choose another path")
    assert (tmp_path / name).read_bytes() == USER
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "nothing else written"


def test_its_own_files_are_replaced_an_edited_one_is_the_users_and_force_overwrites(tmp_path, capsys):
    code, text = main(argv(tmp_path), capsys)
    assert code == 0, text
    train = tmp_path / "train.jsonl"
    first = train.read_bytes()
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    code, text = main(argv(tmp_path), capsys)  # an earlier output of its own: replaced, same bytes
    assert code == 0, text
    assert train.read_bytes() == first
    train.write_bytes(first + USER)  # the user edits it: from now on it is theirs
    refused(*main(argv(tmp_path), capsys), "data.source", "--force")
    assert train.read_bytes() == first + USER
    code, text = main(argv(tmp_path, "--force"), capsys)  # the named file, overwritten on request
    assert code == 0, text
    assert train.read_bytes() == first


def test_a_users_tokenizer_directory_is_never_reused_or_overwritten(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(USER)
    code, text = main(argv(tmp_path), capsys)
    refused(code, text, "model.tokenizer", str(tok), "UniRL did not write", "--force")
    assert (tok / "tokenizer.json").read_bytes() == USER and [p.name for p in tok.iterdir()] == ["tokenizer.json"]
    assert not (tmp_path / "train.jsonl").exists(), "refused before anything was generated"
    code, text = main(argv(tmp_path, "--force"), capsys)  # --force writes beside a user's files, never over
    refused(code, text, "model.tokenizer", "tokenizer.json", "left untouched")
    assert (tok / "tokenizer.json").read_bytes() == USER and [p.name for p in tok.iterdir()] == ["tokenizer.json"]


def test_a_recipe_without_an_environment_is_one_line(tmp_path, capsys):
    code, text = main(["agentic-data", str(ROOT / "recipes" / "arith-tiny.yaml"), f"run.output_dir={tmp_path}"], capsys)
    refused(code, text, "rollout.environment", "search", "fix:")
    code, text = main(["agentic-data", SEARCH, *SMALL, f"data.source={tmp_path / 'x.jsonl'}",
                       f"data.eval_source={tmp_path / 'x.jsonl'}", f"model.tokenizer={tmp_path / 'tok'}"], capsys)
    refused(code, text, "data.eval_source", "same file as data.source")
    assert list(tmp_path.iterdir()) == []
