"""``textworld``: a stateful multi-turn environment over TextWorld games.

* **observation**: the game's text (``observation: compact`` drops the ASCII banner, the status line and
  blank lines), then, with ``admissible_hint``, ``Commands: a | b | ...`` (the game's admissible commands),
  then the prompt ``> ``. The first observation is the dataset prompt itself.
* **action**: free text, the first line of the model's turn (a turn ends at a newline: ``stop``). A command
  the game does not understand is not an error: the game says so and the episode goes on.
* **reward**: the score delta of each step, summed, plus ``win_bonus`` on a win, given when the episode
  ends: on a win, a loss, or after ``max_steps`` commands (the cap).
* **state**: each trajectory plays its own copy of its game (``sample.answer`` is the game key); copies
  are pooled per game, so a reset costs a game restart (~20 ms), not a load. Stateful: a weight sync drops
  an unfinished episode (``tail: auto``), it is never carried.

ALFWorld: its environment contract (text observation, free-text command, admissible commands, a won flag,
a step cap) is this one; ALFWorld itself needs data downloads that cannot be made here, so only TextWorld
games are played and tested.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from unirl.api import Environment, EnvStep, Sample, build_word_demo_tokenizer, progress_bar
from unirl_agentic.games.generate import Split, _textworld, game_key, game_path, generate_games, parse_key
from unirl_agentic.games.options import TextWorldOptions
from unirl_agentic.games.rename import apply_renaming, entity_words, renaming
from unirl_agentic.games.tokenizer import WORD_VOCAB, grammar_words
from unirl_agentic.options import agentic_options
from unirl_agentic.word_tokenizer import tokenizer_dir

#: the prompt ends at ``>`` and a command turn starts with its space (`` take shoe``), as the listed commands
#: are written (``| take shoe``): with a word tokenizer the command's tokens are then the listed command's
#: tokens, so playing a listed command is an exact copy (``> `` then ``take`` would be another token)
PROMPT_END = "\n>"
#: textworld parses a game's logic with a shared tatsu parser that is not thread-safe (two concurrent
#: ``textworld.start`` calls raised ``IndexError: pop from empty list`` in tatsu): loads are serialised
_LOAD_LOCK = threading.Lock()
#: well under jericho's 198-byte input buffer, counted in UTF-8 bytes (a 4-byte character counts 4), so the
#: game sees the command as written
MAX_COMMAND_BYTES = 96


def game_command(turn_text: str) -> str:
    """The command a model turn plays: its first line, without control characters, at most
    ``MAX_COMMAND_BYTES`` of UTF-8 (cut at a character boundary).

    Why: a byte-level model can emit any byte, and the Z-machine interpreter under TextWorld (jericho's
    frotz) hangs or segfaults on a NUL in its input (measured: ``"a\\x00"`` killed the process, so one
    sampled byte took the whole training run down); jericho also truncates past 198 bytes, with a warning
    per step. A command the game does not know is still the game's answer, never an error."""
    line = (turn_text.strip().splitlines() or [""])[0]
    clean = "".join(ch for ch in line if ch.isprintable()).strip()
    return clean.encode()[:MAX_COMMAND_BYTES].decode(errors="ignore").strip()


def textworld_options(config: Any) -> TextWorldOptions:
    """``plugins.agentic.textworld`` (from the kernel-validated section) as the games' options."""
    return TextWorldOptions.model_validate(agentic_options(config).textworld if config else {})


def compact(text: str) -> str:
    """The game's text without the banner (lines with no letter), the status line (``> ... -= Room =-0/1``),
    the restart question and blank lines."""
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if not s or not re.search(r"[A-Za-z]", s) or s.startswith(">") or s.startswith("Would you like to RESTART"):
            continue
        lines.append(s)
    return "\n".join(lines)


@dataclass
class _Episode:
    game: Path
    env: Any
    score: int = 0
    steps: int = 0


class TextWorldEnvironment(Environment):
    stop: tuple[str, ...] = ("\n",)

    def __init__(self, *, config: Any = None, tools: dict | None = None, tokenizer: Any = None,
                 options: TextWorldOptions | None = None, **_: Any):
        self.options = options if options is not None else textworld_options(config)
        self.tokenizer = tokenizer
        self._tw = _textworld()
        # jericho says TextWorld's games are "not fully supported" (its own score detection is off);
        # the score, won and lost flags come from TextWorld's game state, which is what we read
        warnings.filterwarnings("ignore", message=".*is not fully supported.*")
        self._infos = self._tw.EnvInfos(admissible_commands=True, max_score=True, won=True, lost=True,
                                        policy_commands=True, objective=True)
        self._idle: dict[Path, list[Any]] = {}
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._renames = itertools.count()  # a fresh renaming per demonstration
        self._plays: dict[tuple[Path, str, bool], list[tuple[str, str | None]]] = {}

    #: every episode is a live game (a class value, so preflight reads it before anything is built)
    stateful = True

    def live(self) -> list[str]:
        with self._lock:
            return list(self._episodes)

    # ------------------------------------------------------------------ rendering
    def render(self, text: str, state: Any) -> str:
        obs = compact(text) if self.options.observation == "compact" else text.rstrip()
        if self.options.admissible_hint:
            obs += "\nCommands: " + " | ".join(state["admissible_commands"] or [])
        return obs + PROMPT_END

    # ------------------------------------------------------------------ games
    def game(self, key: str) -> Path:
        split, index = parse_key(key)
        return game_path(self.options, split, index)

    def _start(self, game: Path) -> tuple[Any, Any]:
        with self._lock:
            pool = self._idle.get(game)
            env = pool.pop() if pool else None
        if env is None:
            with _LOAD_LOCK:
                env = self._tw.start(str(game), request_infos=self._infos)
        return env, env.reset()

    def _release(self, game: Path, env: Any) -> None:
        with self._lock:
            self._idle.setdefault(game, []).append(env)

    def first_observation(self, key: str) -> tuple[str, list[str]]:
        """The prompt of game ``key`` and its walkthrough (what the dataset and the demonstrations need)."""
        game = self.game(key)
        env, state = self._start(game)
        try:
            return self.render(state.feedback, state), list(state["policy_commands"] or [])
        finally:
            self._release(game, env)

    # ------------------------------------------------------------------ the protocol
    def reset(self, sample: Sample) -> None:
        game = self.game(sample.answer)
        env, _ = self._start(game)
        with self._lock:
            if sample.id in self._episodes:
                self._release(game, env)
                raise ValueError(f"textworld: trajectory {sample.id} was reset twice without close")
            self._episodes[sample.id] = _Episode(game, env)

    def step(self, sample: Sample, turn_text: str) -> EnvStep:
        with self._lock:
            ep = self._episodes.get(sample.id)
        if ep is None:
            raise ValueError(f"textworld: step for {sample.id} before reset (or after close)")
        state, score, done = ep.env.step(game_command(turn_text))
        delta, ep.score, ep.steps = score - ep.score, score, ep.steps + 1
        won, lost = bool(state["won"]), bool(state["lost"])
        sample.meta["score"], sample.meta["won"] = ep.score, won
        sample.meta["max_score"] = state["max_score"]
        sample.meta.setdefault("score_deltas", []).append(delta)
        if done or won or lost or ep.steps >= self.options.max_steps:
            total = float(sum(sample.meta["score_deltas"])) + (self.options.win_bonus if won else 0.0)
            return EnvStep(done=True, reward=total, info={"won": won, "lost": lost, "score": ep.score,
                                                          "steps": ep.steps, "capped": not (done or won or lost)})
        return EnvStep(observation="\n" + self.render(state.feedback, state), reward=float(delta),
                       info={"score": ep.score, "steps": ep.steps})

    def close(self, sample: Sample) -> None:
        with self._lock:
            ep = self._episodes.pop(sample.id, None)
        if ep is not None:
            self._release(ep.game, ep.env)

    def shutdown(self) -> None:
        """Close every pooled game (the controller's ``close`` leaves the pool for reuse)."""
        with self._lock:
            envs = [e for pool in self._idle.values() for e in pool] + [ep.env for ep in self._episodes.values()]
            self._idle.clear()
        for env in envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                pass

    # ------------------------------------------------------------------ demonstrations
    def demonstration(self, prompt: Sample, tokenizer: Any, *, expert: bool) -> Sample:
        """One SFT trace played on the real game: the walkthrough (expert), or ``max_steps`` admissible
        commands that are not in it (an explorer that never acts: it loses to the cap). Built exactly as a
        rollout builds it: commands as model turns, the game's answers as observations (mask 0). With
        ``rename_demonstrations`` the entities' names are other words, fresh on every call (``rename.py``)."""
        game = self.game(prompt.answer)
        turns = self._played(game, f"{prompt.id}:demo", expert=expert)
        if self.options.rename_demonstrations:
            mapping = renaming(entity_words(game), random.Random(f"{prompt.id}:rename:{next(self._renames)}"))
            text = apply_renaming(prompt.prompt_text, mapping)
            prompt = replace(prompt, prompt_ids=list(tokenizer.encode(text, add_special_tokens=False)),
                             prompt_text=text, meta=dict(prompt.meta))
            turns = [(apply_renaming(c, mapping), None if o is None else apply_renaming(o, mapping))
                     for c, o in turns]
        s = prompt.child(0)
        for command, observation in turns:
            ids = tokenizer.encode(command, add_special_tokens=False)
            s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", text=command)
            if observation is not None:
                s.append_observation(tokenizer.encode(observation, add_special_tokens=False), text=observation)
        return s

    def _played(self, game: Path, seed: str, *, expert: bool) -> list[tuple[str, str | None]]:
        """:meth:`_play`, once per ``(game, seed, expert)``: a demonstration is a pure function of them, and a
        warm start replays every training game hundreds of times (3000 steps x 32 traces over 128 games);
        playing them was half of each warm-start step (0.17 s of ~0.35 s for 32 traces)."""
        key = (game, seed, expert)
        with self._lock:
            hit = self._plays.get(key)
        if hit is None:
            hit = self._play(game, seed, expert=expert)
            with self._lock:
                self._plays[key] = hit
        return hit

    def _play(self, game: Path, seed: str, *, expert: bool) -> list[tuple[str, str | None]]:
        """``(command turn, the game's answer or None at the end)`` of one demonstration on the real game."""
        env, state = self._start(game)
        turns: list[tuple[str, str | None]] = []
        try:
            walk = list(state["policy_commands"] or [])
            rng = random.Random(seed)
            for i in range(self.options.max_steps if not expert else len(walk)):
                if expert:
                    command = walk[i]
                else:
                    idle = [c for c in state["admissible_commands"] or [] if c not in walk] or ["look"]
                    command = rng.choice(idle)
                state, _, done = env.step(command)
                if done or state["won"] or state["lost"] or i + 1 >= self.options.max_steps:
                    turns.append((f" {command}\n", None))
                    break
                turns.append((f" {command}\n", "\n" + self.render(state.feedback, state)))
        finally:
            self._release(game, env)
        return turns


def write_dataset(config: Any, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """One row per game (``prompt``: its first observation, ``answer``: its key) for each split, at
    ``data.source`` / ``data.eval_source`` (or in ``out_dir``); generates the games it names."""
    env = TextWorldEnvironment(config=config)
    o = env.options
    if o.word_tokenizer:
        build_word_demo_tokenizer(grammar_words(), WORD_VOCAB, cache_dir=tokenizer_dir(config, "textworld"))
    if out_dir is not None:
        paths = (Path(out_dir) / "train.jsonl", Path(out_dir) / "eval.jsonl")
    else:
        paths = (Path(config.data.source), Path(config.data.eval_source))
    splits: tuple[tuple[Split, int], ...] = (("train", o.n_train), ("eval", o.n_eval))
    keys = [(split, i) for split, n in splits for i in range(n)]
    with progress_bar(config, "textworld games", len(keys)) as bar:
        generate_games(o, keys, progress=bar)
    try:
        for path, (split, n) in zip(paths, splits, strict=True):
            rows = []
            for i in range(n):
                key = game_key(split, i)
                prompt, _ = env.first_observation(key)
                rows.append(json.dumps({"prompt": prompt, "answer": key}))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(rows) + "\n")
    finally:
        env.shutdown()
    return paths


def env_score(completion: str, sample: Sample) -> float:
    """``reward.name: env_score``: the environment scores every episode itself (``EnvStep.reward``), so this
    is never called for its trajectories; if it is, the environment ended one without a reward (a bug)."""
    raise ValueError("env_score: the environment ended this trajectory without a reward (EnvStep.reward); "
                     "fix: a scoring environment (textworld) must set it, or set reward.name to a grader")


env_score.parse_gold = lambda answer: answer  # type: ignore[attr-defined]  # any game key is a valid row
