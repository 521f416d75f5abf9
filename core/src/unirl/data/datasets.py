"""Prompt data: load, validate, tokenize; and the resumable cursor that feeds the trainer.

``load_prompts`` turns ``data.source`` (alias ``data.train``: ``"arith"``, a local ``.jsonl`` / ``.json``
/ ``.parquet`` / ``.csv`` file, a ``save_to_disk`` directory, or a dataset name in the local HF cache,
read with no network) into root :class:`~unirl.samples.Sample` objects:

* ids are ``p{index}``, the row's 0-based index in the dataset (stable: dropping overlong rows leaves
  gaps instead of renumbering, so an id always points at the same row);
* ``prompt_ids`` are ``tokenizer.encode(prompt, add_special_tokens=False)``: no BOS/EOS is added. A
  recipe that needs a BOS or a chat template puts it in the prompt text itself, so what the engine sees
  is exactly what the file says;
* rows are validated before anything is tokenized, and every bad row (up to ``MAX_REPORTED``) is
  reported in one :class:`DataError` naming the file, the row (1-based *line* for ``.jsonl``) and the
  field, with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from unirl.data.image_prompts import with_row_images
from unirl.kernel.errors import DataError, Violation
from unirl.samples import Sample, stable_seed

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig

#: how many bad rows one DataError lists before "... and N more"
MAX_REPORTED = 5

SUPPORTED_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# ------------------------------------------------------------------------------------------ loading


def load_prompts(
    config: RunConfig, tokenizer: Any, split: Literal["train", "eval"], adapter: Any = None
) -> tuple[list[Sample], dict[str, Any]]:
    """Root samples for ``split`` and stats ``{"rows", "rejected_overlong", "truncated", "source"}``.

    ``"rows"`` counts the rows read, before overlong ones are dropped. ``split="eval"`` reads
    ``data.eval_source`` (or the held-out arith split when ``data.source`` is ``"arith"``).
    """
    data = config.data
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if data.source == "arith":
        from unirl.data.arith import arith_rows

        rows = arith_rows(data.arith, split)
        prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
        source = f"arith:{split}"
    else:
        if split == "train":
            path, field = data.source, "data.source"
        else:
            if data.eval_source is None:
                raise DataError(
                    f"data.eval_source is not set: evaluation needs held-out prompts when data.source is a "
                    f"file ({data.source}) (fix: set data.eval_source (alias data.eval) to held-out prompts: a file, a "
                    f"save_to_disk directory or a cached dataset name)"
                )
            path, field = data.eval_source, "data.eval_source"
        split_name = data.train_split if split == "train" else data.eval_split
        prompts, answers = read_prompt_file(path, data.prompt_field, data.answer_field, config_field=field,
                                            split=split_name, subset=data.subset)
        source = str(path)
    samples, stats = tokenize_prompts(
        prompts, answers, tokenizer, max_tokens=data.max_prompt_tokens, overlong=data.overlong, source=source,
        chat_template=data.chat_template, system_prompt=data.system_prompt,
    )
    return with_row_images(samples, config, tokenizer, split, adapter), stats


def read_prompt_file(
    path: str | Path, prompt_field: str, answer_field: str, *, config_field: str = "data.source",
    split: str = "train", subset: str | None = None,
) -> tuple[list[str], list[Any]]:
    """Read a dataset source (a file, a ``save_to_disk`` directory or a dataset name in the local HF
    cache: :func:`read_prompt_rows`) and validate every row.

    Returns the prompt and answer columns. Raises :class:`DataError` for a missing source, an unknown
    extension, an unreadable file, or bad rows (all of them, up to ``MAX_REPORTED``, in one error).
    """
    prompts, answers, _ = read_prompt_rows(path, prompt_field, answer_field, config_field=config_field,
                                           split=split, subset=subset)
    return prompts, answers


def read_prompt_rows(
    path: str | Path, prompt_field: str, answer_field: str, *, config_field: str = "data.source",
    split: str = "train", subset: str | None = None,
) -> tuple[list[str], list[Any], list[str]]:
    """:func:`read_prompt_file`, plus each row's label (``"line K"`` for ``.jsonl``, ``"row K"``
    otherwise): what a later check of the rows (the gold answers, in preflight) names.

    ``path`` is, in this order: an existing file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, read
    through HF ``datasets``); an existing directory written by ``Dataset.save_to_disk`` (a
    ``DatasetDict``'s ``split``); else a dataset name (``owner/name``) read from the local HF datasets
    cache, never from the network (:func:`_load_cached`). ``subset`` is the dataset's configuration
    (HF's ``name``) for a cached dataset."""
    p = Path(str(path)).expanduser()
    if p.is_dir():
        ds = _load_from_disk(p, split, config_field)
        return _validate_rows(path, _columns(ds, prompt_field, answer_field), prompt_field, answer_field)
    if not p.is_file():
        if _looks_like_a_path(str(path)):
            raise DataError(
                f"{config_field}: {path} does not exist (resolved to {p.resolve()}); set {config_field} to "
                f"'arith', a {' / '.join(SUPPORTED_EXTENSIONS)} file, a save_to_disk directory or a dataset "
                "name in the local HF cache"
            )
        ds = _load_cached(str(path), subset, split, config_field)
        return _validate_rows(path, _columns(ds, prompt_field, answer_field), prompt_field, answer_field)
    builder = SUPPORTED_EXTENSIONS.get(p.suffix.lower())
    if builder is None:
        raise DataError(
            f"{config_field}: {path} has unsupported extension {p.suffix or '(none)'!r}; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)}, a save_to_disk directory, or a cached dataset name"
        )
    if builder in ("json", "csv"):
        _check_utf8(p, config_field)  # pyarrow would raise a bare UnicodeDecodeError mid-read
    if builder == "parquet":
        _check_parquet_rows(p, config_field)
    if builder == "csv":
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(lines) <= 1:  # datasets' CSV reader raises "corresponds to no data" on a header alone
            raise DataError(f"{path} has no rows (columns: {lines[0] if lines else 'none'}); fix: point "
                            f"{config_field} at a dataset with rows")
    return _validate_rows(path, _read_table(builder, p, prompt_field, answer_field), prompt_field, answer_field)


def _validate_rows(
    path: str | Path, table: tuple[list[str], list[Any], list[Any], list[str]], prompt_field: str,
    answer_field: str,
) -> tuple[list[str], list[Any], list[str]]:
    """Every row of ``table`` (columns, prompts, answers, labels) checked; all bad rows in one error."""
    columns, prompts, answers, label = table
    n = len(label)
    if n == 0:
        raise DataError(f"{path} has no rows (columns: {', '.join(columns) or 'none'}); fix: point data.source / "
                        "data.eval_source at a dataset with rows")

    missing_cols = [f"data.{k} = {name!r}" for k, name in (("prompt_field", prompt_field), ("answer_field", answer_field))
                    if name not in columns]
    if missing_cols:
        raise DataError(
            f"{path}: no row has the column(s) {', '.join(missing_cols)} (checked all {n} rows); "
            f"fix: set data.prompt_field / data.answer_field (or data.prompt_key / data.answer_key) to the "
            f"column names; available columns: {', '.join(columns)}"
        )

    problems: list[str] = []
    missing_field: set[str] = set()
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        bad = []
        if prompt is None:
            bad.append(f"field {prompt_field!r} is missing or null")
            missing_field.add("prompt_field")
        elif isinstance(prompt, list | tuple):  # a chat-message list (TRL's / verl's conversational format)
            from unirl.data.chat import message_list_problem

            why = message_list_problem(list(prompt))
            if why is not None:
                bad.append(f"field {prompt_field!r}: {why}")
        elif not isinstance(prompt, str):
            bad.append(f"field {prompt_field!r} must be a string or a list of chat messages, got "
                       f"{type(prompt).__name__} ({_short(prompt)})")
        elif not prompt.strip():
            bad.append(f"field {prompt_field!r} is an empty string")
        if answer is None:
            bad.append(f"field {answer_field!r} is missing or null")
            missing_field.add("answer_field")
        if bad:
            problems.append(f"{label[i]}: {'; '.join(bad)}")
    if problems:
        if missing_field:
            which = " / ".join(f"data.{k}" for k in sorted(missing_field, reverse=True))
            fix = (f"fix these rows, or set {which} to the column name; available columns: "
                   f"{', '.join(columns)}")
        else:
            fix = (f"fix these rows: {prompt_field!r} must hold the prompt text as a non-empty string, or a "
                   "list of {role, content} chat messages ending on a user turn")
        raise DataError(_bad_rows_message(path, problems, fix, n))
    return prompts, answers, label


def tokenize_prompts(
    prompts: list[str],
    answers: list[Any],
    tokenizer: Any,
    *,
    max_tokens: int,
    overlong: Literal["reject", "truncate"] = "reject",
    source: str = "",
    chat_template: bool = False,
    system_prompt: str | None = None,
) -> tuple[list[Sample], dict[str, Any]]:
    """Encode (no special tokens; or, with ``chat_template``, the tokenizer's chat template around a user
    turn, after ``system_prompt``'s system turn, with the generation prompt: :mod:`unirl.data.chat`) and
    apply the overlong policy; ids are ``p{index}``. ``prompt_text`` stays the row's text (what rewards
    and environments read), not the rendered template.

    ``reject`` drops prompts longer than ``max_tokens``; ``truncate`` keeps their *last* ``max_tokens``
    tokens (the question's end, where the answer is cued) and re-decodes ``prompt_text`` from them.
    """
    samples: list[Sample] = []
    rejected = truncated = longest = 0
    for i, (text, answer) in enumerate(zip(prompts, answers, strict=True)):
        meta: dict[str, Any] = {}
        if not isinstance(text, str):  # a chat-message list: rendered by the template, never as plain text
            if not chat_template:
                raise DataError(f"{source}: row {i + 1}'s prompt is a list of chat messages; fix: set "
                                "data.chat_template: true (the tokenizer's template renders them)")
            meta["messages"] = [dict(m) for m in text]
        if chat_template:
            from unirl.data.chat import chat_prompt_ids, last_user_text

            ids, _ = chat_prompt_ids(tokenizer, text, system_prompt)  # prompt_text stays the row's text
            if "messages" in meta:
                text = last_user_text(meta["messages"])  # what rewards read; the whole list is in meta
        else:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        longest = max(longest, len(ids))
        if len(ids) > max_tokens:
            if overlong == "reject":
                rejected += 1
                continue
            ids = ids[-max_tokens:]
            text = tokenizer.decode(ids)
            meta["truncated_prompt"] = True
            truncated += 1
        samples.append(Sample(id=f"p{i}", prompt_ids=ids, prompt_text=text, answer=answer, meta=meta))
    stats = {"rows": len(prompts), "rejected_overlong": rejected, "truncated": truncated, "source": source}
    if not samples:
        if rejected:
            raise DataError(
                f"{source}: all {rejected} prompts are longer than data.max_prompt_tokens={max_tokens} tokens "
                f"(longest: {longest}); fix: raise data.max_prompt_tokens or set data.overlong=truncate"
            )
        raise DataError(f"{source}: no prompts")
    return samples, stats


def _read_table(
    builder: str, path: Path, prompt_field: str, answer_field: str
) -> tuple[list[str], list[Any], list[Any], list[str]]:
    """(columns, prompt column, answer column, 1-based row labels); a missing column reads as []."""
    try:
        ds = _load_dataset(builder, path)
    except DataError:
        if builder != "json":
            raise
        # datasets' json reader gives up on some valid JSON Lines (a blank line plus a column of mixed
        # types) and says nothing useful about invalid ones: read it line by line instead.
        return _scan_jsonl(path, prompt_field, answer_field)
    columns, prompts, answers, label = _columns(ds, prompt_field, answer_field)
    if builder == "json":  # the file's line for JSON Lines (datasets skips blank lines)
        label = _row_labels(path, len(label))
    elif builder == "csv":  # the file's line: the header is line 1
        label = [f"line {i + 2}" for i in range(len(label))]
    return columns, prompts, answers, label


def _columns(ds: Any, prompt_field: str, answer_field: str) -> tuple[list[str], list[Any], list[Any], list[str]]:
    """(columns, prompt column, answer column, ``row K`` labels) of a loaded ``datasets.Dataset``."""
    columns = list(ds.column_names)
    prompts = list(ds[prompt_field]) if prompt_field in columns else []
    answers = list(ds[answer_field]) if answer_field in columns else []
    return columns, prompts, answers, [f"row {i + 1}" for i in range(len(ds))]


def source_kind(spec: str) -> str:
    """What a ``data.source`` / ``data.eval_source`` names, decided as :func:`read_prompt_rows` reads it:
    ``arith`` (the built-in generator), ``directory`` (save_to_disk), ``file``, or ``name`` (a dataset
    in the local HF cache). Preflight's rules for the split and subset keys read this."""
    if spec == "arith":
        return "arith"
    p = Path(str(spec)).expanduser()
    if p.is_dir():
        return "directory"
    return "file" if p.is_file() or _looks_like_a_path(str(spec)) else "name"


def _looks_like_a_path(spec: str) -> bool:
    """A spec that can only be a path (an extension we read, a directory part that is not ``owner/``,
    ``./``, ``~``): a missing one is reported as a missing file, not looked up as a dataset name."""
    p = Path(spec)
    return (p.suffix.lower() in SUPPORTED_EXTENSIONS or p.is_absolute() or spec.startswith((".", "~"))
            or spec.count("/") > 1 or "\\" in spec)


def _split_of(dd: Any, split: str, where: str, config_field: str) -> Any:
    if split not in dd:
        key = "data.train_split" if config_field == "data.source" else "data.eval_split"
        raise DataError(f"{config_field}: {where} has no split {split!r}; its splits: {', '.join(dd)} "
                        f"(fix: set {key} to one of them)")
    return dd[split]


def _load_from_disk(path: Path, split: str, config_field: str) -> Any:
    """A directory ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) wrote."""
    import datasets

    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise DataError(f"{config_field}: {path} is a directory but not one written by save_to_disk (no state.json "
                        "or dataset_dict.json); fix: give a file in it, or save the dataset with "
                        "Dataset.save_to_disk")
    if _saved_empty(path):  # datasets' reader fails with an IndexError on a dataset saved with no rows
        raise DataError(f"{path} has no rows (save_to_disk wrote no data files); fix: point {config_field} at a "
                        "dataset with rows")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a damaged directory
        raise DataError(f"{config_field}: could not read {path} with datasets.load_from_disk: "
                        f"{type(exc).__name__}: {exc}") from exc
    return _split_of(ds, split, str(path), config_field) if isinstance(ds, datasets.DatasetDict) else ds


def _saved_empty(path: Path) -> bool:
    import json

    try:
        return not json.loads((path / "state.json").read_text()).get("_data_files", [None])
    except (OSError, ValueError):
        return False


def _load_cached(name: str, subset: str | None, split: str, config_field: str) -> Any:
    """A dataset by name from the local HF datasets cache (``HF_DATASETS_CACHE``), with no network.

    Why the cache reader and not ``load_dataset(name)``: a run must not reach the Hub (a cluster node
    often cannot, and a dataset that changed upstream would change the run). This is the reader
    ``load_dataset`` itself falls back to under ``HF_DATASETS_OFFLINE=1``: the newest cached copy."""
    import os

    import datasets
    from datasets.packaged_modules.cache.cache import Cache

    cache = os.environ.get("HF_DATASETS_CACHE") or str(datasets.config.HF_DATASETS_CACHE)
    try:
        builder = Cache(cache_dir=cache, dataset_name=name.split("/")[-1], repo_id=name, config_name=subset,
                        version="auto", hash="auto")
    except ValueError as exc:
        raise DataError(
            f"{config_field}: {name!r} is not a file or directory, and not a dataset in the local HF cache "
            f"({cache}{', subset ' + repr(subset) if subset else ''}: {exc}); runs never download. Fix: give a "
            f"path, or fetch it once where there is network (`python -c \"import datasets; "
            f"datasets.load_dataset('{name}')\"`) with the same HF_DATASETS_CACHE"
        ) from exc
    splits = list(builder.info.splits or {})
    if split not in splits:
        key = "data.train_split" if config_field == "data.source" else "data.eval_split"
        raise DataError(f"{config_field}: the cached dataset {name!r} has no split {split!r}; its splits: "
                        f"{', '.join(splits)} (fix: set {key} to one of them)")
    return builder.as_dataset(split=split)


def _scan_jsonl(
    path: Path, prompt_field: str, answer_field: str
) -> tuple[list[str], list[Any], list[Any], list[str]]:
    import json

    columns: dict[str, None] = {}
    prompts, answers, label, problems = [], [], [], []
    with path.open(encoding="utf-8", errors="replace") as f:
        for k, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {k}: invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                problems.append(f"line {k}: expected a JSON object, got {type(row).__name__}")
                continue
            columns.update(dict.fromkeys(row))
            prompts.append(row.get(prompt_field))
            answers.append(row.get(answer_field))
            label.append(f"line {k}")
    if problems:
        raise DataError(_bad_rows_message(path, problems, "fix: each line must be one JSON object"))
    cols = list(columns)
    return cols, prompts if prompt_field in cols else [], answers if answer_field in cols else [], label


def _bad_rows_message(path: Path | str, problems: list[str], fix: str, n: int | None = None) -> str:
    shown = "\n".join(f"  {msg}" for msg in problems[:MAX_REPORTED])
    more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    of = f" of {n}" if n is not None else ""
    return f"{path}: {len(problems)} bad row(s){of}:\n{shown}{more}\n{fix}"


def _check_utf8(path: Path, config_field: str) -> None:
    """JSON Lines must be UTF-8: name every line that is not (up to ``MAX_REPORTED``) and the fix."""
    bad = []
    with path.open("rb") as f:
        for k, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(f"line {k}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
    if bad:
        raise DataError(_bad_rows_message(path, bad, f"re-save {config_field} as UTF-8 (for example "
                                                     "`iconv -f latin1 -t utf-8`)"))


def _check_parquet_rows(path: Path, config_field: str) -> None:
    """A valid Parquet file with no rows is called empty (datasets' reader fails on it with a generic
    generation error, which read as "unreadable"); a damaged one is left to the reader's message."""
    try:
        import pyarrow.parquet as pq

        meta = pq.read_metadata(str(path))
    except Exception:  # noqa: BLE001 - not readable as Parquet: _load_dataset names it
        return
    if meta.num_rows == 0:
        raise DataError(f"{config_field}: {path} is empty: a valid Parquet file with no rows (columns: "
                        f"{', '.join(meta.schema.names) or 'none'}); fix: point {config_field} at a dataset with rows")


def _load_dataset(builder: str, path: Path):
    import datasets

    bars_on = datasets.is_progress_bar_enabled()
    if bars_on:
        datasets.disable_progress_bars()
    # datasets logs pyarrow's own "row N" parse error before raising; ours names the file's line instead
    quiet = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets/pyarrow raise many types for a malformed file
        kind = {"json": "JSON Lines (one JSON object per line) or a JSON array of objects", "csv": "CSV with a "
                "header line"}.get(builder, "Parquet")
        raise DataError(f"could not read {path} as {kind}: {type(exc).__name__}: {exc}") from exc
    finally:
        datasets.logging.set_verbosity(quiet)
        if bars_on:
            datasets.enable_progress_bars()


def _row_labels(path: Path, n: int) -> list[str]:
    """``"line K"`` for each row: datasets' json reader skips blank lines, so count non-blank ones."""
    lines = []
    with path.open("rb") as f:
        for k, raw in enumerate(f, start=1):
            if raw.strip():
                lines.append(k)
    if len(lines) != n:  # an unexpected layout (e.g. a JSON array): fall back to row numbers
        return [f"row {i + 1}" for i in range(n)]
    return [f"line {k}" for k in lines]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------ cursor


class PromptCursor:
    """Deterministic, resumable batches of training prompts.

    Each epoch visits the prompts in the order ``shuffle(seed, epoch)``; a batch never spans two epochs
    (the tail of an epoch shorter than a batch is skipped, a different tail each epoch), so a batch
    never holds the same prompt twice (two copies would merge into one GRPO group). ``state_dict`` is
    ``(epoch, position)``: a restored cursor yields exactly what the uninterrupted one would have.
    Batches are copies; the cursor's own samples are never handed out.
    """

    def __init__(self, prompts: list[Sample], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(prompts) < batch_size:
            raise DataError(
                f"{len(prompts)} training prompts cannot fill one batch of trainer.prompts_per_step="
                f"{batch_size}; fix: lower trainer.prompts_per_step or add prompts"
            )
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            import random

            order = list(range(len(self.prompts)))
            random.Random(stable_seed(self.seed, "prompt-cursor", self.epoch)).shuffle(order)
            self._order = order
        return self._order

    def next_batch(self) -> list[Sample]:
        return self.next(self.batch_size)

    def next(self, k: int) -> list[Sample]:
        """The next ``k`` prompts (a rollout controller draws as many as it needs). Like a batch, they
        never span two epochs, so one draw never holds the same prompt twice."""
        if not 1 <= k <= len(self.prompts):
            raise ValueError(f"PromptCursor.next: k={k} must be in 1..{len(self.prompts)} (the number of prompts)")
        if self.position + k > len(self.prompts):
            self.epoch += 1
            self.position = 0
            self._order = None
        order = self._epoch_order()
        batch = [self.prompts[i].copy() for i in order[self.position : self.position + k]]
        self.position += k
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        n = state.get("num_prompts", len(self.prompts))
        if n != len(self.prompts):
            raise DataError(
                f"cannot resume the prompt cursor: the checkpoint was taken with {n} training prompts, "
                f"the data now has {len(self.prompts)} (was data.source or data.max_prompt_tokens changed?)"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        self._order = None


def data_violations(config: RunConfig, gold: Mapping[str, Callable[[Any], Any]] | None = None) -> list[Violation]:
    """Preflight's cheap read of every dataset file: encoding, JSON, required fields, non-empty, enough
    rows for one batch, and every gold answer readable by the reward (``gold``: ``{reward name:
    parse_gold}``, :func:`unirl.rewards.build.gold_parsers`). No tokenizer and no model: it runs before
    anything expensive. The built-in ``arith`` source is not read: its answers are integers it made."""
    data, out = config.data, []
    if data.source == "arith":
        return out
    for path, field in ((data.source, "data.source"), (data.eval_source, "data.eval_source")):
        if path is None:
            out.append(Violation("unirl-core", field, f"not set: evaluation needs held-out prompts when data.source "
                                 f"is not arith ({data.source})", "set data.eval_source (alias data.eval) to held-out "
                                 "prompts: a file, a save_to_disk directory or a cached dataset name"))
            continue
        try:
            split_name = data.train_split if field == "data.source" else data.eval_split
            prompts, answers, labels = read_prompt_rows(path, data.prompt_field, data.answer_field, config_field=field,
                                                        split=split_name, subset=data.subset)
        except DataError as exc:
            out.append(Violation("unirl-core", field, str(exc).removeprefix(f"{field}: ")))
            continue
        if not data.chat_template and any(not isinstance(p, str) for p in prompts):
            out.append(Violation("unirl-core", "data.chat_template", f"{path}: its {data.prompt_field!r} column holds "
                                 "chat-message lists, which only the tokenizer's chat template renders",
                                 "set data.chat_template: true"))
        if field == "data.source" and len(prompts) < config.trainer.prompts_per_step:
            out.append(Violation("unirl-core", field, f"{path} has {len(prompts)} rows, fewer than one batch "
                                 f"(trainer.prompts_per_step={config.trainer.prompts_per_step})",
                                 "add rows or lower trainer.prompts_per_step"))
        for name, parse in (gold or {}).items():
            out += gold_answer_violations(path, field, data.answer_field, answers, labels, name, parse)
    return out


def gold_answer_violations(path: str, field: str, answer_field: str, answers: list[Any], labels: list[str],
                           reward: str, parse: Callable[[Any], Any]) -> list[Violation]:
    """One violation naming the rows whose gold answer ``reward`` cannot parse (the first
    ``MAX_REPORTED``, with the count), or none.

    Why at preflight: the reward raises on such an answer, so each of its samples fails at run time;
    a file of them trains on failed rewards until the failure guard stops it, steps later."""
    bad: list[tuple[str, Any]] = []
    first = ""
    seen: dict[str, str] = {}  # repr(answer) -> why it failed ("" = parsed): a repeated answer is parsed once
    for label, answer in zip(labels, answers, strict=True):
        key = f"{type(answer).__name__}:{answer!r}"
        if key not in seen:
            try:
                parse(answer)
                seen[key] = ""
            except Exception as exc:  # noqa: BLE001 - any failure to parse is the finding
                seen[key] = str(exc) or type(exc).__name__
        if seen[key]:
            bad.append((label, answer))
            first = first or seen[key]
    if not bad:
        return []
    shown = ", ".join(f"{label} {_short(answer)}" for label, answer in bad[:MAX_REPORTED])
    more = f", and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
    return [Violation("unirl-core", field, f"{path}: reward '{reward}' cannot parse {len(bad)} of {len(answers)} "
                      f"gold answers ({answer_field!r}): {shown}{more}; every such sample would fail ({first})",
                      f"correct those {answer_field!r} values, or set reward.name to a reward that reads them")]
