"""The library's configuration: typed sections for what moe/ does, and the checks behind them.

Each section is a dataclass for one part of the library (data and tokenizer: moe/data/sources.py;
model and moe: moe/model/transformer.py, moe/model/routing.py, moe/model/growth.py; the training sections:
moe/train/trainer.py; checkpoint: moe/checkpoint/store.py; evaluate: moe/sql/evaluate.py). Its defaults *are*
the embedded default: a tiny model that runs the whole pipeline on a 2-core CPU in minutes.

How the pipeline runs (storage, pools, cost, recovery, multi-node, W&B), the stage list and
the reading of `params.yaml` belong to the orchestration and live in tasks/config.py; this
module knows no file, no stage and no machine.

`build` turns a nested mapping into a section; `validate` checks what each field declares
(`knob`: a range or a pattern), every nested section, then the section's own `check` (the
rules across fields), adding what is wrong to a `Problems`; all are reported together, each
with its key path, the offending value, what is allowed and (when read from a file) the line.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import inspect
import io
import math
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from moe.errors import InputError


class ConfigError(InputError):
    """One or more configuration problems; `str()` lists each on its own line."""

    def __init__(self, problems: list[str], source: str = "params") -> None:
        self.problems = problems
        self.source = source
        super().__init__(
            f"{source}: {len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


FROM_SET = -1  # line marker: the value came from a --set override


class Problems:
    """Collects problems with their key paths; `section()` nests the path."""

    def __init__(self, lines: dict[str, int] | None = None, filename: str = "") -> None:
        self.items: list[str] = []
        self.prefix: list[str] = []
        self.lines = lines or {}
        self.filename = filename

    def section(self, name: str) -> _Section:
        return _Section(self, name)

    def add(self, key: str, value: Any, why: str) -> None:
        """`key = value: why (file, line N)`."""
        path = self._path(key)
        self.items.append(f"{path} = {value!r}: {why}{self._where(path)}")

    def note(self, key: str, why: str) -> None:
        """`key: why (file, line N)`: a problem with a whole key rather than its value."""
        path = self._path(key)
        self.items.append(f"{path}: {why}{self._where(path)}")

    def _path(self, key: str) -> str:
        return ".".join([*self.prefix, key]) if key else ".".join(self.prefix)

    def _where(self, path: str) -> str:
        line = self.lines.get(path)
        if line is None:  # fall back to the nearest enclosing key with a known line
            parts = path.split(".")
            while parts and line is None:
                parts.pop()
                line = self.lines.get(".".join(parts))
        if line == FROM_SET:
            return " (from --set)"
        if line is not None and self.filename:
            return f" ({self.filename}, line {line})"
        return ""

    def require(self, ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            self.add(key, value, why)


class _Section:
    def __init__(self, problems: Problems, name: str) -> None:
        self.problems, self.name = problems, name

    def __enter__(self) -> None:
        self.problems.prefix.append(self.name)

    def __exit__(self, *exc: object) -> None:
        self.problems.prefix.pop()


def knob(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    pattern: str | None = None,
    note: str = "",
) -> Any:
    """A field with what it allows declared beside it. `validate` refuses a number outside
    its range as "must be >= 1", "must be in (0, 1]" and so on, followed by `note`; a string
    that does not match `pattern` (the whole of it) as "must be <note>"."""
    if pattern is not None:
        return field(default=default, metadata={"pattern": pattern, "note": note})
    return field(default=default, metadata={"bounds": (ge, gt, le, lt), "note": note})


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _allowed(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    lo = f"[{_number(ge)}" if ge is not None else f"({_number(gt)}" if gt is not None else ""
    hi = f"{_number(le)}]" if le is not None else f"{_number(lt)})" if lt is not None else ""
    if lo and hi:
        return f"must be in {lo}, {hi}"
    if lo:
        return f"must be >= {_number(ge)}" if ge is not None else f"must be > {_number(gt)}"
    return f"must be <= {_number(le)}" if le is not None else f"must be < {_number(lt)}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """What the source says about each field of the config dataclass `cls`: the comment
    lines right above it and the comments on its own line(s), joined into one text (the
    Prefect form's descriptions, tasks/form.py). One source of truth: the comment a reader of
    this file sees is the description a user of the form sees."""
    src = textwrap.dedent(inspect.getsource(cls))
    docs: dict[str, str] = {}
    above: list[str] = []
    name: str | None = None
    parts: list[str] = []
    start = True  # at the start of a logical line of the class body
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if name is not None:
                parts.append(text)
            elif start and tok.start[1] == 4:  # a comment line of the body, not a method's
                above.append(text)
            continue
        if tok.type == tokenize.NL:
            continue
        if tok.type == tokenize.NEWLINE:
            if name is not None:
                docs[name] = " ".join([*above, *parts]).strip()
            name, parts, above, start = None, [], [], True
            continue
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        if start:
            start = False
            if tok.type == tokenize.NAME and tok.start[1] == 4:
                name = tok.string  # kept below only if it names a field
            else:
                above = []
    fields = {f.name for f in dataclasses.fields(cls)}
    own = {k: v for k, v in docs.items() if k in fields}
    for base in cls.__mro__[1:]:  # inherited fields keep their base's comments
        if dataclasses.is_dataclass(base):
            own = {**field_docs(base), **own}
    return {k: v for k, v in own.items() if k in fields}


def validate(section: Any, p: Problems) -> None:
    """The one validation path of every section: each field's declared range (`knob`), each
    nested section and mapping of sections under its key path, then the section's own
    `check`, which holds only the rules that relate fields to each other."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "bounds" in f.metadata and isinstance(value, (int, float)):
            ge, gt, le, lt = f.metadata["bounds"]
            ok = (
                (ge is None or value >= ge)
                and (gt is None or value > gt)
                and (le is None or value <= le)
                and (lt is None or value < lt)
            )
            p.require(ok, f.name, value, _allowed(ge, gt, le, lt) + f.metadata["note"])
        elif "pattern" in f.metadata:
            ok = isinstance(value, str) and re.fullmatch(f.metadata["pattern"], value) is not None
            p.require(ok, f.name, value, f"must be {f.metadata['note']}")
        elif dataclasses.is_dataclass(value):
            with p.section(f.name):
                validate(value, p)
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):  # None: refused when it was built
                    with p.section(f"{f.name}.{key}"):
                        validate(item, p)
    if hasattr(section, "check"):
        section.check(p)


# auto, cpu, cuda or cuda:N: where a stage trains or evaluates.
DEVICE = r"auto|cpu|cuda(:\d+)?"


# --------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    # "stdlib" = the Python standard library's sources on this machine; otherwise a local
    # text/JSONL/Parquet file or folder.
    source: str = "stdlib"
    text_field: str = "text"  # the field holding the text in a JSONL or Parquet source
    on_bad_record: Literal["error", "skip"] = (
        "error"  # a malformed JSONL line: stop, or skip and count
    )
    max_bytes: int = knob(4_000_000, ge=0)  # cap on corpus size read (0 = no cap)
    # Text files (.txt/.md/.py/.sql/.rst) are decoded with this codec (any Python codec name:
    # utf-8, latin-1, cp1252, ...); a file that does not decode is named and refused (a lone
    # file) or skipped and listed (in a folder). The stdlib corpus is always UTF-8.
    encoding: str = "utf-8"
    # A text file longer than this (in characters) is cut into documents at paragraph breaks,
    # so that one big file (a book as nanoGPT's input.txt) splits into train/val/replay.
    doc_max_bytes: int = knob(16_384, ge=256)
    val_fraction: float = knob(
        0.05, gt=0.0, lt=0.5
    )  # fraction of documents held out for validation
    replay_fraction: float = knob(
        0.05, ge=0.0, lt=0.5, note=" (0 = no replay split)"
    )  # held back from pretraining for finetune replay
    seed: int = 1337  # shuffles the documents before the validation and replay splits
    # Where prepare writes the token files, the tokenizer and the SQL pairs.
    out_dir: str = "data/prepared"
    # Stage one of finetuning: "generated" (the embedded default: databases built from ten
    # themes, questions generated from their schemas), a folder in Spider's or BIRD's layout,
    # or a JSONL file of {question, sql, db} with db a sqlite path relative to the file.
    sql_generic_source: str = "generated"
    sql_generic_pairs: int = knob(10_000, ge=1)  # at most this many generic training pairs
    # Generic questions never trained on, stratified by kind: half on the training
    # databases, half on databases no training pair uses.
    sql_generic_test_pairs: int = knob(
        200, ge=2, note=" (half on training databases, half on held-out ones)"
    )
    # A folder source: the pair file (by name, without .json) that is the test split
    # (Spider's and BIRD's dev.json); without one, a share of the databases is held out.
    sql_generic_test_split: str = "dev"
    sql_generic_heldout_dbs: float = knob(
        0.2, ge=0, lt=1
    )  # share of a source's databases held out for testing when it has no test split
    # Stage two: the target domain. A sqlite file of the user's ("" = the embedded default's
    # generated database; only read, never written: the pipeline works on a copy), or a
    # database on a server by SQLAlchemy URL, without a password: postgresql+psycopg://
    # reader@host:5432/shop (pairs are written and checked in its dialect, on the server).
    sql_domain_database: str = ""
    # Where a server database's password comes from: env:NAME (an environment variable) or
    # prefect:BLOCK (a Prefect Secret block); "" = the driver's own (PGPASSWORD, ~/.pgpass).
    sql_domain_password: str = knob(
        "", pattern=r"|env:\w+|prefect:[\w-]+", note="'', env:NAME or prefect:BLOCK"
    )
    # The server's schema (namespace) whose tables the model is taught ("" = the session's
    # current schema, e.g. public).
    sql_domain_schema: str = ""
    sql_domain_views: bool = False  # a server schema's views count as tables too
    # The user's own {question, sql} pairs on that database (JSONL; optional).
    sql_domain_pairs: str = ""
    # The held-out domain questions: a JSONL file of the user's, or a fraction of
    # sql_domain_pairs ("" = 0.3 of them when there are any; else generated ones).
    sql_domain_test: str = ""
    # Domain training pairs: the user's, then pairs generated from the database's own schema
    # and rows up to this many in all.
    sql_domain_train_pairs: int = knob(500, ge=1)
    # Generated held-out domain questions (used when the user gives none).
    sql_domain_test_pairs: int = knob(
        200, ge=1, note=" (generated test questions, when the user gives none)"
    )
    sql_domain_pairs_weight: float = knob(
        3.0, gt=0
    )  # how much more often a user-written pair is drawn than a generated one
    # Up to this many sample values of each categorical column in the schema the model reads
    # (0 = none; dropped first when an example does not fit max_len).
    sql_schema_values: int = knob(0, ge=0, le=30)
    # An example whose database's whole schema does not fit the model gets the tables and
    # columns its question names (by names and by values the database holds; a training
    # example keeps its gold SQL's tables), recorded with the example. false = shorten the
    # whole schema instead (sample values, then types) and refuse what still does not fit.
    sql_schema_pruning: bool = True
    # Every execution of SQL on the databases (prepare's checks, evaluation, `ask`): a
    # statement running longer or returning more rows counts as failed.
    # Seconds a statement may run before it counts as failed.
    sql_time_limit_s: float = knob(2.0, gt=0)
    # Rows a statement may return before it counts as failed.
    sql_row_limit: int = knob(10_000, ge=1)

    def check(self, p: Problems) -> None:
        try:
            codecs.lookup(self.encoding)
            known = True
        except LookupError:
            known = False
        p.require(known, "encoding", self.encoding, "not a known text encoding (e.g. utf-8)")
        p.require(bool(self.text_field), "text_field", self.text_field, "must not be empty")
        for key in ("sql_domain_database", "sql_domain_pairs"):
            value = getattr(self, key)
            if key == "sql_domain_database" and "://" in value:
                # a server: its URL is a param (dumped, recorded), so it holds no password
                userinfo = value.split("//", 1)[1].split("/", 1)[0].rpartition("@")[0]
                p.require(
                    ":" not in userinfo,
                    key,
                    "(a URL with a password, not shown)",
                    "must not hold a password: remove it and set data.sql_domain_password",
                )
                engine, _, driver = value.split("://", 1)[0].partition("+")
                p.require(
                    ":" in userinfo or (engine == "postgresql" and driver in ("", "psycopg")),
                    key,
                    value,
                    "must be a sqlite file or a PostgreSQL URL (postgresql+psycopg://user@host/db):"
                    " only PostgreSQL has a sandbox here (moe/sql/server.py)",
                )
                continue
            p.require(not value or Path(value).expanduser().is_file(), key, value, "no such file")
        src = self.sql_generic_source
        p.require(
            src == "generated" or Path(src).expanduser().exists(),
            "sql_generic_source",
            src,
            "must be 'generated', a Spider/BIRD folder or a JSONL file that exists",
        )
        test = self.sql_domain_test
        try:
            fraction = 0 < float(test) < 1
        except ValueError:
            fraction = False
        p.require(
            not test or fraction or Path(test).expanduser().is_file(),
            "sql_domain_test",
            test,
            "must be a JSONL file that exists or a fraction in (0, 1)",
        )
        p.require(
            not test or not fraction or bool(self.sql_domain_pairs),
            "sql_domain_test",
            test,
            "a fraction of the user's pairs needs data.sql_domain_pairs",
        )


@dataclass
class TokenizerConfig:
    # Byte-level BPE vocabulary trained on the corpus (ignored with tokenizer.path).
    vocab_size: int = knob(
        4096, ge=259, le=1048576, note=": 256 byte tokens + 2 special tokens + at least one merge"
    )
    min_frequency: int = knob(2, ge=1)  # a pair must occur this often to become a merge
    train_bytes: int = knob(
        50_000_000, ge=0, note=" (0 = all)"
    )  # train the BPE on at most this much of the corpus (0 = all)
    path: str = ""  # an existing tokenizer.json to use instead of training one
    # With tokenizer.path (a model's own tokenizer): ask the model in its chat template when
    # it has one (chat_template.jinja beside it), in finetuning, evaluation and `ask` alike.
    chat_template: bool = True

    def check(self, p: Problems) -> None:
        if self.path:
            p.require(
                Path(self.path).is_file(), "path", self.path, "must name an existing tokenizer.json"
            )


# ModelConfig.rope_scaling's keys for rope_type yarn (moe/model/rope.py; truncate as 1 or 0).
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def rope_scaling_problem(rope_type: str, scaling: dict[str, float]) -> str | None:
    """Why ModelConfig.rope_scaling does not fit its rope_type, or None."""
    if rope_type == "default":
        return "must be empty with model.rope_type default" if scaling else None
    unknown = sorted(set(scaling) - set(YARN_KEYS))
    if unknown:
        return f"unknown key(s) {', '.join(unknown)}; YaRN's are {', '.join(YARN_KEYS)}"
    needed = ("factor", "original_max_position_embeddings")
    missing = [k for k in needed if k not in scaling]
    if missing:
        return f"YaRN needs {' and '.join(missing)}"
    if not all(scaling[k] > 0 for k in needed):
        return "YaRN's factor and original_max_position_embeddings must be > 0"
    return None


@dataclass
class ModelConfig:
    # The model to start from: "" = our architecture from random weights (the embedded
    # default); a local Hugging Face folder (config.json, safetensors, tokenizer.json) or a
    # folder written by `moe-pipeline model import`. The architecture fields below are then
    # read from it (moe/hf/architecture.py) and what params.yaml says about them is not used.
    init: str = ""
    # With model.init: "continue" = the pretrain stage continues pretraining the imported
    # model on the corpus (set a small pretrain.lr); "skip" = it passes the model on as it is.
    init_pretrain: Literal["continue", "skip"] = "continue"
    n_layer: int = knob(2, ge=1)  # transformer blocks
    n_head: int = knob(4, ge=1)  # attention (query) heads per block
    # Key/value heads (grouped-query attention): n_head must be a multiple (0 = n_head).
    n_kv_head: int = knob(0, ge=0, note=" (0 = n_head)")
    # Width of one attention head (0 = d_model / n_head); Qwen3 sets it explicitly.
    head_dim: int = knob(0, ge=0, note=" (0 = d_model / n_head)")
    d_model: int = knob(128, ge=1)  # width of the residual stream
    # 192: the longest generated example (a join: schema, question and SQL) is ~180 tokens
    seq_len: int = knob(192, ge=1)
    moe_every: int = knob(1, ge=1)  # an MoE feed-forward in every Nth block (1 = every block)
    # Blocks (0-based) that stay dense whatever moe_every says (Hugging Face's mlp_only_layers)
    dense_layers: list[int] = field(default_factory=list)
    dense_hidden: int = knob(512, ge=1)  # feed-forward width of the non-MoE blocks
    tie_embeddings: bool = True  # the output head shares the token embedding's weights
    # RMSNorm on queries and keys before the rotation: per head (Qwen3), over the whole
    # projection (OLMoE), or none.
    qk_norm: Literal["none", "head", "full"] = "none"
    attn_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # Rotary positions on the first rotary_dim features of each head only (GLM-4.5 rotates
    # half of each head); 0 = the whole head.
    rotary_dim: int = knob(0, ge=0, note=" (0 = the whole head)")
    # "gqa": grouped-query heads. "mla": DeepSeek-V3's multi-head latent attention, keys and
    # values read from one compressed latent per token; head_dim is then the width of a
    # query/key head's un-rotated part (qk_nope_head_dim).
    attention: Literal["gqa", "mla"] = "gqa"
    # mla: width of the compressed query (q_lora_rank); 0 = an uncompressed query projection.
    mla_q_rank: int = knob(0, ge=0, note=" (0 = an uncompressed query projection)")
    mla_kv_rank: int = knob(64, ge=1)  # mla: width of the key/value latent (kv_lora_rank)
    # mla: the rotated part of each query and key head, one key part shared by all heads
    # (qk_rope_head_dim).
    mla_rope_dim: int = knob(16, ge=2)
    mla_v_dim: int = knob(0, ge=0, note=" (0 = head_dim)")  # mla: width of a value head
    attn_out_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    # A learned logit per head in the denominator of its attention softmax, attended to with
    # no value, so that a head can attend to nothing (gpt-oss's attention sinks).
    attn_sinks: bool = False
    # Sliding-window attention: a query of a block in sliding_layers sees itself and the
    # sliding_window - 1 tokens before it (0 = no window).
    sliding_window: int = knob(0, ge=0, note=" (0 = no window)")
    # Blocks (0-based) with the sliding window; the others see every earlier token (gpt-oss
    # alternates them).
    sliding_layers: list[int] = field(default_factory=list)
    rope_theta: float = knob(10_000.0, gt=0)  # base of the rotary position frequencies
    # RoPE scaling: default = plain RoPE; yarn = YaRN (Peng et al. 2023: frequencies
    # interpolated by band, cos and sin scaled by an attention factor) with rope_scaling.
    rope_type: Literal["default", "yarn"] = "default"
    # YaRN's numbers as a checkpoint gives them (moe/model/rope.py): factor and
    # original_max_position_embeddings, optionally beta_fast, beta_slow, truncate (1 or 0),
    # attention_factor, mscale, mscale_all_dim.
    rope_scaling: dict[str, float] = field(default_factory=dict)
    norm_eps: float = knob(1e-5, gt=0)  # epsilon of every RMSNorm
    init_std: float = knob(0.02, gt=0)  # std of the normal init of linear and embedding weights

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // max(self.n_head, 1)

    @property
    def rope_width(self) -> int:
        """The rotated features of a query or key head."""
        if self.attention == "mla":
            return self.mla_rope_dim
        return self.rotary_dim or self.head_width

    @property
    def v_width(self) -> int:
        """The width of a value head."""
        return (self.mla_v_dim or self.head_width) if self.attention == "mla" else self.head_width

    def window(self, i: int) -> int:
        """Block i's attention window in tokens (0 = every earlier token)."""
        return self.sliding_window if i in self.sliding_layers else 0

    def is_moe_block(self, i: int) -> bool:
        """Blocks moe_every-1, 2*moe_every-1, ... are MoE, except the listed dense ones."""
        return i % self.moe_every == self.moe_every - 1 and i not in self.dense_layers

    def check(self, p: Problems) -> None:
        if self.n_head >= 1 and self.d_model >= 1 and not self.head_dim:
            p.require(
                self.d_model % self.n_head == 0,
                "d_model",
                self.d_model,
                f"must be divisible by n_head ({self.n_head}) unless model.head_dim is set",
            )
        if self.n_head >= 1 and self.d_model >= 1 and self.attention == "gqa":
            p.require(
                self.head_width % 2 == 0,
                "head_dim" if self.head_dim else "d_model",
                self.head_dim or self.d_model,
                "the head width must be even (rotary positions)",
            )
            p.require(
                self.rotary_dim <= self.head_width and self.rotary_dim % 2 == 0,
                "rotary_dim",
                self.rotary_dim,
                f"must be even and at most the head width ({self.head_width})",
            )
        if self.attention == "mla":
            p.require(
                not (self.attn_sinks or self.sliding_layers or self.attn_out_bias),
                "attention",
                self.attention,
                "latent attention has no sinks, sliding window or output bias (gpt-oss's)",
            )
            p.require(
                self.qk_norm == "none" and not self.attn_bias and not self.rotary_dim,
                "attention",
                self.attention,
                "latent attention has no q/k norm, q/k/v biases or model.rotary_dim (its"
                " rotated part is mla_rope_dim)",
            )
            p.require(
                self.mla_rope_dim % 2 == 0,
                "mla_rope_dim",
                self.mla_rope_dim,
                "must be even (rotary positions)",
            )
            p.require(
                self.n_kv_head in (0, self.n_head),
                "n_kv_head",
                self.n_kv_head,
                "must be 0 with attention: mla (every head reads the shared latent)",
            )
        if self.n_kv_head:
            p.require(
                self.n_head % self.n_kv_head == 0,
                "n_kv_head",
                self.n_kv_head,
                f"must divide n_head ({self.n_head})",
            )
        for i, layer in enumerate(self.dense_layers):
            p.require(
                0 <= layer < self.n_layer,
                f"dense_layers[{i}]",
                layer,
                f"must be a block index in [0, {self.n_layer - 1}]",
            )
        for i, layer in enumerate(self.sliding_layers):
            p.require(
                0 <= layer < self.n_layer,
                f"sliding_layers[{i}]",
                layer,
                f"must be a block index in [0, {self.n_layer - 1}]",
            )
        if self.sliding_layers:
            p.require(
                self.sliding_window > 0,
                "sliding_window",
                self.sliding_window,
                "must be > 0 when model.sliding_layers names blocks",
            )
        why = rope_scaling_problem(self.rope_type, self.rope_scaling)
        p.require(why is None, "rope_scaling", self.rope_scaling, why or "")


@dataclass
class GrowthConfig:
    """Expert growth and pruning (moe/model/growth.py). Off by default."""

    enabled: bool = False  # grow experts in skewed layers and prune dead ones while pretraining
    check_every: int = knob(10, ge=1)  # steps between trigger checks
    top_fraction: float = knob(0.2, gt=0, lt=1)  # grow when the top 20% of experts...
    top_load: float = knob(0.8, gt=0, le=1)  # ...carry more than 80% of the load,
    importance_var: float = knob(
        0.25, gt=0
    )  # or the importance variance exceeds this (seed: 0.2-0.3)
    # ...and, either way, only while the layer's load CV is above this: importance also
    # reads gradient norms, uneven in a balanced layer too (bench/RESULTS.md, growth).
    min_load_cv: float = knob(0.5, ge=0)
    cooldown: int = knob(5000, ge=1)  # steps between growth events in one layer (seed: 5000)
    max_experts: int = 32  # per layer
    ema: float = knob(0.98, ge=0, lt=1)  # moving average of activation frequency and gradient norm
    ramp_steps: int = knob(100, ge=1)  # a new expert's router offset ramps from -20 to 0 over these
    # orthogonal: new weights orthogonal to the layer's experts, at their mean norm;
    # split: the hottest expert's weights plus an orthogonal component of 10% of their norm.
    # split is the default: with aux_free balancing it ends more balanced and no worse in
    # loss than orthogonal (bench/RESULTS.md, expert growth, three seeds).
    init: Literal["orthogonal", "split"] = "split"
    prune: bool = True  # merge an expert that stays under u_min into its nearest
    u_min: float = knob(
        0.05, ge=0, lt=1
    )  # prune an expert under 5% of its fair share of the load...
    prune_window: int = knob(
        1000, ge=1
    )  # ...for this many consecutive steps (merged into its nearest)
    min_experts: int = knob(2, ge=1)  # per layer, never below moe.top_k


BalancingMethod = Literal[
    "aux_loss", "z_loss", "cv_penalty", "util_aware", "rebalance", "aux_free", "warmup"
]
BALANCING_METHODS: tuple[str, ...] = get_args(BalancingMethod)


@dataclass
class MoEConfig:
    num_experts: int = knob(8, ge=1)  # routed experts per MoE layer
    top_k: int = knob(2, ge=1)  # experts each token is sent to
    expert_hidden: int = knob(256, ge=1)  # feed-forward width of one expert
    # Dropless: every routed token is computed. Otherwise an expert takes at most
    # capacity_factor * tokens * top_k / num_experts assignments per batch and the
    # lowest-scoring overflow is dropped (its residual passes through).
    dropless: bool = True
    capacity_factor: float = 1.25  # with dropless off: an expert's capacity in fair shares
    # Typical: 1.2-1.5 early (routing still moves), 0.8-1.0 late. Above 0: capacity_factor moves linearly to this
    # value over the training run; 0 = constant.
    capacity_factor_end: float = knob(0.0, ge=0, note=" (0 = constant capacity_factor)")
    # Renormalise the kept top-k weights to sum to 1; at top-1 the one choice then weighs 1
    # (Mixtral, Qwen3-MoE's norm_topk_prob). false: the router's probabilities as they are
    # (Switch's top-1, where the gate learns through the weight).
    renormalize: bool = True
    jitter: float = knob(
        0.0, ge=0, lt=1
    )  # Switch: multiply router inputs by U(1-jitter, 1+jitter) in training
    # Load balancing; any combination of the methods in BALANCING_METHODS (see moe/model/routing.py):
    balancing: list[BalancingMethod] = field(default_factory=lambda: ["aux_free", "z_loss"])
    aux_loss_coef: float = knob(0.01, ge=0)  # aux_loss: Switch/GShard E * sum f_i * P_i
    z_loss_coef: float = knob(0.001, ge=0)  # z_loss: ST-MoE router z-loss
    cv_penalty_coef: float = knob(0.01, ge=0)  # cv_penalty: std/mean of expert load
    util_alpha: float = knob(0.2, ge=0)  # util_aware: alpha (0.1-0.3 is the usual range)
    util_momentum: float = knob(
        0.99, ge=0, lt=1
    )  # util_aware/rebalance: moving average of utilisation
    rebalance_every: int = knob(1000, ge=1)  # rebalance: recalibrate the gate every this many steps
    rebalance_beta: float = knob(
        0.1, gt=0, lt=1
    )  # rebalance: gate row e *= 1 - beta * (util_e - 1)
    # aux_free: the bias update speed u. DeepSeek-V3 uses 0.001 over ~15T tokens; in a run of a
    # few hundred steps that moves the bias too little (measured: MaxVio 1.47 after 100 steps at
    # 0.001, 0.17 at 0.01; bench/RESULTS.md).
    aux_free_rate: float = knob(0.01, gt=0)
    warmup_steps: int = knob(50, ge=0)  # warmup: uniform routing for this many pretraining steps...
    warmup_blend_steps: int = knob(
        50, ge=0
    )  # ...then the router's choice blended in over this many
    router_lr_mult: float = knob(3.0, gt=0)  # routers learn 3-5x faster than the base rate
    shared_expert: bool = False  # an always-on expert beside the routed ones (DeepSeek/Qwen2-MoE)
    shared_expert_hidden: int = knob(0, ge=0, note=" (0 = expert_hidden)")  # its feed-forward width
    # The shared expert's output scaled by sigmoid(a learned gate) per token (Qwen2-MoE).
    shared_expert_gate: bool = False
    # How the router scores experts: a softmax over them (Mixtral, Qwen), or an independent
    # sigmoid per expert (DeepSeek-V3, GLM-4.5; the chosen weights then renormalised when
    # moe.renormalize). aux_free's bias is added to these scores to choose.
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # Group-limited routing (DeepSeek-V3): the experts in n_group equal groups, each scored by
    # its two best scores; a token chooses among its topk_group best groups only. 1 = none.
    n_group: int = knob(1, ge=1)
    topk_group: int = knob(1, ge=1)  # with n_group > 1: the groups a token may route into
    # The routed experts' combined output times this (DeepSeek-V3's routed_scaling_factor).
    routed_scale: float = knob(1.0, gt=0)
    # The experts' activation: swiglu = silu(gate) * up; clamped_swiglu (gpt-oss) = gate *
    # sigmoid(act_alpha * gate) * (up + 1), gate clamped above at act_limit, up to
    # [-act_limit, act_limit].
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    act_alpha: float = knob(1.702, gt=0)  # clamped_swiglu: the gain inside the sigmoid
    act_limit: float = knob(7.0, gt=0)  # clamped_swiglu: where the gate and up are clamped
    # Biases on each expert's gate/up and down projections (gpt-oss).
    expert_proj_bias: bool = False
    # A learned bias on the router's logits, which both chooses and weights experts (gpt-oss).
    router_logit_bias: bool = False
    force_balanced: bool = False  # debug: round-robin routing, for throughput/memory tests
    # Expert growth and pruning while training (moe/model/growth.py); off by default.
    growth: GrowthConfig = field(default_factory=GrowthConfig)

    def check(self, p: Problems) -> None:
        if self.growth.enabled:
            for key in ("expert_proj_bias", "router_logit_bias"):
                p.require(
                    not getattr(self, key),
                    key,
                    getattr(self, key),
                    "expert growth does not grow these biases: turn moe.growth.enabled off",
                )
            p.require(
                self.growth.max_experts >= self.num_experts,
                "growth.max_experts",
                self.growth.max_experts,
                f"must be >= moe.num_experts ({self.num_experts})",
            )
            p.require(
                self.growth.min_experts >= self.top_k,
                "growth.min_experts",
                self.growth.min_experts,
                f"must be >= moe.top_k ({self.top_k})",
            )
        p.require(
            self.top_k <= self.num_experts,
            "top_k",
            self.top_k,
            f"must be <= moe.num_experts ({self.num_experts})",
        )
        if not self.dropless:
            p.require(
                self.capacity_factor > 0,
                "capacity_factor",
                self.capacity_factor,
                "must be > 0 when moe.dropless is false",
            )
        if self.n_group > 1:
            p.require(
                not self.growth.enabled,
                "growth.enabled",
                self.growth.enabled,
                "expert growth changes the expert count that moe.n_group divides into groups",
            )
            size = self.num_experts // self.n_group
            p.require(
                self.num_experts % self.n_group == 0 and size >= 2,
                "n_group",
                self.n_group,
                f"must divide moe.num_experts ({self.num_experts}) into groups of 2 or more",
            )
            p.require(
                self.topk_group <= self.n_group and self.top_k <= self.topk_group * size,
                "topk_group",
                self.topk_group,
                f"must be <= moe.n_group ({self.n_group}) and its groups must hold moe.top_k"
                f" ({self.top_k}) experts",
            )
        p.require(
            not (self.score_func == "sigmoid" and "util_aware" in self.balancing),
            "balancing",
            self.balancing,
            "util_aware scales softmax logits; it does not apply with score_func: sigmoid",
        )
        p.require(
            len(set(self.balancing)) == len(self.balancing),
            "balancing",
            self.balancing,
            "names a method twice",
        )


@dataclass
class EarlyStopConfig:
    """Early stopping (moe/train/early_stop.py): composite score, lr-scaled patience, cost-aware stop."""

    patience: int = knob(
        0, ge=0, note=" (0 = off)"
    )  # evaluations without improvement before stopping, at the initial lr; 0 = off
    min_delta: float = knob(0.001, ge=0)  # an improvement smaller than this does not count
    util_weight: float = knob(
        0.5, ge=0
    )  # composite = val_loss + util_weight * (1 - expert utilisation)
    value_per_loss: float = (
        knob(
            0.0, ge=0, note=" (0 = off)"
        )  # currency value of lowering val loss by 1.0; 0 = no cost-aware stop
    )
    trend_window: int = knob(3, ge=2)  # evaluations fitted to project the remaining improvement


@dataclass
class LoraTargets:
    """Which projections carry adapters (moe/adapters/lora.py). All on by default: the QLoRA
    paper and LLaMA-Factory's `all` found adapters on every linear layer needed to match full
    finetuning; attention only (the original LoRA paper) learns less per step."""

    attention: bool = True  # q, k, v and the output projection
    mlp: bool = True  # the dense blocks' SwiGLU (gate, up, down)
    shared_expert: bool = True  # the MoE layers' shared expert (gate, up, down)
    # The routed experts' 3-D weights: one low-rank pair per expert and projection, computed
    # through the same grouped dispatch as the experts (PEFT's `target_parameters`).
    experts: bool = True  # the routed experts, through the grouped dispatch


@dataclass
class LoraConfig:
    """Low-rank adapters for `method: lora | qlora`: W x + (alpha / rank) B A x with B = 0 at
    the start (PEFT's and torchtune's rule), the base frozen. Rank 8 with alpha 16 (a scale of
    2) is LLaMA-Factory's and torchtune's default; dropout 0 is Unsloth's and LLaMA-Factory's."""

    rank: int = knob(8, ge=1)  # the adapters' rank r
    alpha: float = knob(16.0, gt=0)  # scale = alpha / rank
    dropout: float = knob(0.0, ge=0, lt=1)  # on the adapters' input only
    targets: LoraTargets = field(default_factory=LoraTargets)  # where adapters go
    # The routed experts' rank: "same" gives every expert `rank`; "divided" gives each
    # rank // num_experts (at least 1), so all experts together hold about one adapter's
    # parameters (PEFT's advice for `target_parameters`, whose rank is per expert).
    expert_rank: Literal["same", "divided"] = "same"  # each routed expert's rank
    train_embeddings: bool = False  # the token embeddings stay frozen unless asked
    train_head: bool = False  # the output head stays frozen unless asked
    # QLoRA: the frozen base in NF4 (torchao), this many weights per quantisation block
    # (64: the QLoRA paper's and torchao's default); adapters in fp32, compute in bf16 on CUDA.
    nf4_block: int = knob(64, ge=16)  # weights per NF4 block (QLoRA)


@dataclass
class OptimConfig:
    """What every training stage shares: steps and batches, the optimiser, where and how it
    runs, how often it logs and saves, and on how many processes and machines."""

    max_steps: int = knob(300, ge=1)  # optimizer steps of the stage
    batch_size: int = knob(16, ge=1)  # sequences per step (over all processes)
    grad_accum: int = knob(1, ge=1)  # micro-batches whose gradients make one step
    lr: float = knob(2e-3, gt=0)  # peak learning rate (AdamW)
    warmup_steps: int = knob(30, ge=0)  # linear warm-up to lr over this many steps
    weight_decay: float = knob(0.1, ge=0)  # AdamW weight decay (not on norms, biases or embeddings)
    beta1: float = knob(0.9, ge=0, lt=1)  # AdamW beta1
    beta2: float = knob(0.95, ge=0, lt=1)  # AdamW beta2
    grad_clip: float = knob(
        1.0, ge=0, note=" (0 = no clipping)"
    )  # max_norm (2.0 is a common choice under bf16)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    # Where it trains: auto (a GPU when there is one), cpu, cuda or cuda:N.
    device: str = knob("auto", pattern=DEVICE, note="auto, cpu, cuda or cuda:N")
    seed: int = 1337  # model init, data order and dropout
    # Steps between metrics rows (W&B, metrics.jsonl, the progress bar).
    log_every: int = knob(10, ge=1)
    # Steps between checkpoints (with checkpoint.every: stage).
    checkpoint_every: int = knob(100, ge=1)
    # Above 0: stop after this many seconds of training; the lr decay follows the time used when
    # that is ahead of the steps, so the run still ends annealed. 0 = max_steps only.
    time_budget_s: float = knob(0.0, ge=0, note=" (0 = off)")
    # Processes on this machine (torchrun: data parallel + expert parallel); moe.num_experts
    # and batch_size must divide by it. 0 = one per GPU of the stage's pool
    # (pools.definitions.POOL.gpus; one where the machine turns out to have no GPU).
    nproc: int = knob(0, ge=0, note=" (0 = one per GPU of the pool)")
    # Above one process the dense blocks are sharded over all of them (FSDP2) and the experts
    # over groups of this many (expert parallelism: each holds num_experts / this of them).
    # It must divide the world size and moe.num_experts; 0 = all the processes, 1 = experts
    # sharded with the dense blocks, no token exchange.
    expert_parallel: int = knob(0, ge=0, note=" (0 = all the processes)")
    # Recompute each block's activations in the backward instead of keeping them: less
    # memory for longer sequences or larger batches, about a third more compute.
    activation_checkpoint: bool = False
    # Compile each block with torch.compile (regional compilation, as torchtitan): the blocks
    # share one compiled program, compiled in seconds rather than the whole model's minutes;
    # fused kernels for what runs between the products. Worth it on a GPU; on a CPU the
    # compile costs more than it saves in a short stage.
    compile: bool = False
    # Machines this stage spans, each with the processes above (world size = nodes x
    # processes). Above 1 the stage's flow run launches a Kubernetes Indexed Job of that many
    # pods (tasks/multinode.py, the `multinode` section); data, the start model and the
    # checkpoints reach every node through the object store.
    nodes: int = knob(1, ge=1)
    # What trains: "full" (every weight, AdamW state for all of them), "lora" (low-rank
    # adapters on a frozen base: the `lora` section) or "qlora" (the same on a base stored in
    # 4-bit NF4). The adapted model is merged into the stage's model folder when it ends, so
    # the next stage, `ask` and the export read it as any model; the adapters alone are kept
    # beside it (adapter.safetensors) for `model export`'s PEFT folder.
    method: Literal["full", "lora", "qlora"] = "full"  # what trains
    lora: LoraConfig = field(default_factory=LoraConfig)  # the adapters of lora and qlora
    # The routers under this stage: "trained" (gate weights learn, the aux-free bias moves),
    # "frozen" (nothing moves: a narrow domain cannot collapse the routing the base learned),
    # "bias-only" (only the aux-free bias moves, so the load still balances). "auto": frozen
    # under lora and qlora (as PEFT, which does not adapt routers), trained under full.
    router: Literal["auto", "trained", "frozen", "bias-only"] = "auto"  # what routing moves

    def router_policy(self) -> str:
        """The router policy this stage runs with ("auto" resolved)."""
        if self.router != "auto":
            return self.router
        return "trained" if self.method == "full" else "frozen"


@dataclass
class PretrainConfig(OptimConfig):
    """Pretraining: warm-up + cosine decay to min_lr, validation, early stopping."""

    min_lr: float = knob(2e-4, ge=0)  # the cosine decay ends here
    eval_every: int = knob(100, ge=1)  # steps between validation losses
    eval_batches: int = knob(8, ge=1)  # batches per validation
    # Stop when the validation loss stops improving.
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)

    def check(self, p: Problems) -> None:
        p.require(self.min_lr <= self.lr, "min_lr", self.min_lr, f"must be <= lr ({self.lr})")


@dataclass
class FinetuneConfig(OptimConfig):
    """Supervised finetuning on prompt -> SQL pairs: linear decay, loss on response tokens."""

    max_steps: int = knob(900, ge=1)  # optimizer steps of the stage
    # Peak learning rate (AdamW); on finetune_sql 2e-3 beat 3e-3 over 3 seeds (bench/RESULTS.md).
    lr: float = knob(2e-3, gt=0)
    warmup_steps: int = knob(10, ge=0)  # linear warm-up to lr over this many steps
    weight_decay: float = knob(0.0, ge=0)  # AdamW weight decay
    # Steps between checkpoints (with checkpoint.every: stage).
    checkpoint_every: int = knob(50, ge=1)
    max_len: int = knob(
        192, ge=8
    )  # prompt + response tokens; prepare fits every example to it or refuses (moe/sql/fitting.py)
    # Rows of pretraining text added to each batch, as a fraction of batch_size (replay:
    # keeps the model from forgetting what pretraining taught it).
    replay_ratio: float = knob(0.25, ge=0, le=4)
    # Where replay rows come from: "train" (the pretraining text itself, ~1M tokens on the
    # default: no row is seen twice) or "replay" (the split held back from pretraining by
    # data.replay_fraction; ~55k tokens on the default, so a long finetune memorises it and
    # forgets the rest: bench/RESULTS.md).
    replay_split: Literal["train", "replay"] = "train"
    focus_weight: float = knob(2.0, gt=0)  # loss weight of focus tokens (below)
    # The SQL keywords, and the digits: the numbers of a question must be copied exactly, and
    # mis-copied digits were the errors left (weighting them lifted the domain accuracy over
    # three seeds from 0.83 to 0.95 and the weakest seed from 0.715 to 0.855: bench/RESULTS.md).
    focus_tokens: list[str] = field(
        default_factory=lambda: [
            *("SELECT", "WHERE", "JOIN", "GROUP", "ORDER", "COUNT", "LIMIT"),
            *"0123456789",
        ]
    )


@dataclass
class CheckpointConfig:
    """Tiered checkpoints: see moe/checkpoint/store.py."""

    max_retain: int = knob(3, ge=1)  # keep the last 3 (plus the best, plus the bases they need)
    keep_best: bool = True  # also keep the checkpoint with the lowest validation loss
    hot_every: int = knob(
        100, ge=1
    )  # steps between full writes of L0 (shared) and L1 (hot experts)
    cold_every: int = knob(1000, ge=1)  # steps between full writes of L2 (cold experts)
    cold_threshold: float = knob(
        0.5, ge=0, le=1
    )  # an expert below this x its layer's mean load is cold
    # Codec of the hot tiers L0/L1: byte-grouped zstd or raw.
    hot_codec: Literal["bg-zstd", "raw"] = "bg-zstd"
    hot_level: int = knob(1, ge=1, le=22, note=" (zstd levels)")  # fast (~220 MB/s here)
    # fp16-zstd is LOSSY (an option for the cold tier): marked in the manifest and on restore.
    cold_codec: Literal["bg-zstd", "bg-lzma", "fp16-zstd"] = "bg-zstd"
    # L2 is written rarely: slow; ~3% smaller than level 1 on bf16 (bench/RESULTS.md).
    cold_level: int = knob(19, ge=1, le=22, note=" (zstd levels)")
    background: bool = True  # encode and write on a worker thread; training only copies
    # Cold data to cheap object storage. After each save and at the end of a
    # training stage, move the newest checkpoint's cold tier (L2) and every older
    # checkpoint's tensors to the `storage` object store; restore fetches them back.
    offload: bool = False
    cold_storage_class: str = "STANDARD_IA"  # S3 storage class of offloaded files ("" = default)
    # How often a training stage saves. "stage": every checkpoint_every steps of the stage.
    # "auto": Young/Daly (moe/train/resilience.py) from the measured save stall, the step time and
    # the stage pool's mean_hours_between_interruptions; the first save comes after at most
    # 10 steps to measure the stall, and a pool declaring no interruptions keeps the stage's
    # checkpoint_every. The choice and its inputs are logged and kept in the lineage record.
    every: Literal["stage", "auto"] = "stage"


@dataclass
class EvaluateConfig:
    # Held-out pairs to generate SQL for, per set and model (0 = every one: 200 domain and
    # 200 generic questions by default). Decoding is batched with a KV cache.
    max_examples: int = knob(0, ge=0, note=" (0 = all)")
    max_new_tokens: int = knob(72, ge=1)  # the longest test answer must fit (prepare checks)
    # Test-suite accuracy: a right answer must also be right on this many differently filled
    # copies of its database (moe/sql/testsuite.py; 0 = execution accuracy alone).
    test_suite: int = knob(3, ge=0, le=20)
    # Execution-guided self-consistency (moe/sql/consistency.py): the greedy answer and
    # candidates - 1 sampled at `temperature`, each run on the question's database, the
    # answer most of them agree on. 1 = greedy decoding alone.
    candidates: int = knob(1, ge=1, le=32)
    temperature: float = knob(0.8, gt=0, le=2)  # of the sampled candidates
    val_batches: int = knob(16, ge=1)  # batches of held-out text per perplexity
    batch_size: int = knob(64, ge=1)  # questions decoded together
    # auto: the GPU when the evaluating machine has one, else the CPU
    device: str = knob("auto", pattern=DEVICE, note="auto, cpu, cuda or cuda:N")
    # Last: the final model as a Hugging Face folder (models/export, with its model card),
    # and that folder published where the data is (storage; storage.hf_model_repo for a Hub
    # model repo), read back and checked by hash.
    export_model: bool = True
    publish_model: bool = True  # publish the export (needs export_model)


# --------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, dict):
        return str(tp).replace("typing.", "")
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )


def _convert(value: Any, tp: Any, p: Problems, key: str) -> Any:
    """Convert a YAML value to `tp`, recording a problem (and returning None) on mismatch."""
    origin = get_origin(tp)
    bad = object()
    out: Any = bad
    if dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            with p.section(key):
                return build(tp, value, p)
    elif origin is Literal:
        if value in get_args(tp):
            out = value
    elif origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, list):
            items = [_convert(v, item_tp, p, f"{key}[{i}]") for i, v in enumerate(value)]
            return items
    elif origin is dict:
        _, val_tp = get_args(tp)
        if isinstance(value, dict):
            with p.section(key):
                return {str(k): _convert(v, val_tp, p, str(k)) for k, v in value.items()}
    elif tp is bool:
        if isinstance(value, bool):
            out = value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):
            # PyYAML reads "3e-4" (no dot) as a string; accept any float() literal.
            try:
                out = float(value)
            except ValueError:
                pass
        if out is not bad and not math.isfinite(out):
            # No knob means anything at inf or nan: refused here, once, for every float field.
            p.add(key, value, "must be a finite number (not inf or nan)")
            return None
    elif tp is str:
        if isinstance(value, str):
            out = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out = str(value)
    if out is bad:
        p.add(key, value, f"expected {_type_name(tp)}")
        return None
    return out


def build(cls: type, raw: dict[str, Any], p: Problems) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            p.add(str(key), value, f"unknown key; allowed keys here: {', '.join(sorted(names))}")
            continue
        converted = _convert(value, hints[key], p, key)
        if converted is not None:
            kwargs[key] = converted
    obj = cls(**kwargs)
    return obj
